"""The benchmarks that users and maintainers rerun; each writes its part of results/.

Run each as a module from the repository root, e.g. ``python -m benchmarks.fidelity``
(``make bench`` runs ``python -m benchmarks.run_all``)."""
