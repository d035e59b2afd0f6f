"""Hostile and broken command lines, in-process: every one gives one line naming the option
(or MODEL) and what it accepts, exit 2 when argparse refuses the value, 1 when wrapopt does,
and no traceback (issue 33). Files given on the command line: test_files.py."""

from __future__ import annotations

import pytest

from tests.reliability.common import ERROR, USAGE, assert_cli_refuses, case

GPT = ["zoo:gpt-tiny"]
SEARCH = ["search", *GPT, "--world-size", "8"]
BENCH = ["bench", *GPT]
PROFILE = ["profile-fabric", "--out", "never-written.json"]

# Numbers: each refused where it enters, naming the option; none replaced by a default (issue 33).
NUMBERS = [
    case(["trace", *GPT, "--batch", "0"], USAGE, "--batch", "positive integer", id="trace-batch-0"),
    case(["trace", *GPT, "--batch", "-3"], USAGE, "--batch", id="trace-batch-negative"),
    case(["trace", *GPT, "--batch", "two"], USAGE, "--batch", "'two'", id="trace-batch-word"),
    case(["trace", *GPT, "--seq", "0"], USAGE, "--seq", id="trace-seq-0"),
    case(["trace", *GPT, "--depth", "-1"], USAGE, "--depth", id="trace-depth-negative"),
    case(["search", *GPT, "--world-size", "0"], USAGE, "--world-size", id="search-world-0"),
    case(["search", *GPT, "--world-size", "1.5"], USAGE, "--world-size", id="search-world-fraction"),
    case([*SEARCH, "--gpus-per-node", "0"], USAGE, "--gpus-per-node", id="search-gpus-per-node-0"),
    case([*SEARCH, "--trials", "-1"], USAGE, "--trials", "at least 0", id="search-trials-negative"),
    case([*SEARCH, "--seed", "-1"], USAGE, "--seed", id="search-seed-negative"),
    case([*SEARCH, "--seed", str(2**32)], USAGE, "--seed", "4294967295", id="search-seed-past-numpy"),
    case([*SEARCH, "--timeout", "0"], USAGE, "--timeout", "above 0", id="search-timeout-0"),
    case([*SEARCH, "--timeout", "nan"], USAGE, "--timeout", id="search-timeout-nan"),
    case([*SEARCH, "--timeout", "inf"], USAGE, "--timeout", id="search-timeout-inf"),
    case([*SEARCH, "--shard-size", "0"], USAGE, "--shard-size", id="search-shard-size-0"),
    case([*SEARCH, "--max-group", "0"], USAGE, "--max-group", id="search-max-group-0"),
    case([*SEARCH, "--tp", "0"], USAGE, "--tp", "auto or a positive integer", id="search-tp-0"),
    case([*SEARCH, "--tp", "two"], USAGE, "--tp", id="search-tp-word"),
    case([*SEARCH, "--accumulation", "0"], USAGE, "--accumulation", id="search-accumulation-0"),
    case(["estimate", *GPT, "--world-size", "-8"], USAGE, "--world-size", id="estimate-world-negative"),
    case(["estimate", *GPT, "--gpus-per-node", "0"], USAGE, "--gpus-per-node", id="estimate-gpus-per-node-0"),
    case(["demo", "--world-size", "1"], USAGE, "--world-size", "at least 2", id="demo-world-1"),
    case(["demo", "--repeats", "0"], USAGE, "--repeats", id="demo-repeats-0"),
    case([*BENCH, "--world-size", "1"], USAGE, "--world-size", id="bench-world-1"),
    case([*BENCH, "--ranks-per-node", "0"], USAGE, "--ranks-per-node", id="bench-ranks-per-node-0"),
    case([*BENCH, "--repeats", "0"], USAGE, "--repeats", id="bench-repeats-0"),
    case([*BENCH, "--confirm", "-1"], USAGE, "--confirm", id="bench-confirm-negative"),
    case([*BENCH, "--confirm-repeats", "0"], USAGE, "--confirm-repeats", id="bench-confirm-repeats-0"),
    case([*BENCH, "--budgets", "tight,lots"], ERROR, "'lots'", "--budgets", "12MiB", id="bench-budget-word"),
    case([*BENCH, "--budgets", "tight,0"], ERROR, "'0'", "--budgets", id="bench-budget-0"),
    case(["demo", "--memory", "nan"], ERROR, "'nan'", "--memory", id="demo-budget-nan"),
    case([*PROFILE, "--world-size", "1"], USAGE, "--world-size", id="profile-world-1"),
    case([*PROFILE, "--ranks-per-node", "0"], USAGE, "--ranks-per-node", id="profile-ranks-per-node-0"),
    case([*PROFILE, "--repeats", "0"], USAGE, "--repeats", id="profile-repeats-0"),
    case([*PROFILE, "--warmup", "-1"], USAGE, "--warmup", id="profile-warmup-negative"),
    case([*PROFILE, "--timeout", "-5"], USAGE, "--timeout", id="profile-timeout-negative"),
    case([*PROFILE, "--sizes", "4 parsecs"], USAGE, "--sizes", id="profile-sizes-unit"),
    case([*PROFILE, "--sizes", ","], USAGE, "--sizes", id="profile-sizes-empty"),
    case([*PROFILE, "--tp", "1"], USAGE, "--tp", id="profile-tp-1"),
    case(["search", *GPT], USAGE, "--world-size", id="search-no-world"),
    # past a model's limit: an error naming the limit, not a value cut back
    case(["trace", "zoo:llama-7b", "--seq", "8192"], ERROR, "--seq 8192", "limit of 4096", id="trace-seq-past-llama"),
    case(["trace", "zoo:gpt-tiny", "--seq", "65"], ERROR, "--seq 65", "limit of 64", id="trace-seq-past-gpt"),
    case(["trace", "zoo:vit-tiny", "--seq", "8"], ERROR, "--seq", "no token sequence", id="trace-seq-on-images"),
    case(["search", *GPT, "--world-size", "12", "--gpus-per-node", "8"], ERROR, "--world-size 12", "--gpus-per-node 8",
         id="search-world-not-whole-nodes"),
    case([*SEARCH, "--shard-size", "3"], ERROR, "--shard-size 3", "1, 2, 4, 8", id="search-shard-size-not-divisor"),
    case([*SEARCH, "--shard-size", "16"], ERROR, "--shard-size 16", id="search-shard-size-past-world"),
    case([*SEARCH, "--tp", "3"], ERROR, "--tp 3", id="search-tp-not-divisor"),
    case(["estimate", *GPT, "--plan", "fastest"], ERROR, "--plan", "per-block", id="estimate-unknown-plan"),
]

# Per-rank memory budgets (--memory): one line naming the option and the forms it accepts.
BUDGETS = [
    case(["estimate", *GPT, f"--memory={value}"], ERROR, "--memory", "80GiB", id=f"memory-{name}")
    for name, value in (("zero", "0"), ("nan", "nan"), ("inf", "inf"), ("negative", "-5GiB"), ("unit", "80XB"),
                        ("overflow", "1e999"), ("word", "lots"), ("below-a-byte", "0.5"))
]

# MODEL strings: every source names what is wrong and what MODEL accepts.
SOURCES = [
    case(["trace"], ERROR, "MODEL", "--list", id="no-model"),
    case(["trace", "gpt-tiny"], ERROR, "'gpt-tiny'", "wrapopt trace --list", id="no-prefix"),
    case(["trace", "zoo:gpt-huge"], ERROR, "gpt-huge", "gpt-tiny", id="unknown-zoo-model"),
    case(["trace", "no_such_package.models:build"], ERROR, "cannot import 'no_such_package.models'",
         id="module-not-found"),
    case(["trace", "tests.reliability.broken_import:build"], ERROR, "importing", "RuntimeError",
         "a module-level setting is missing", id="module-raises-on-import"),
    case(["trace", "tests.reliability.hostile_models:missing"], ERROR, "no callable 'missing'", id="no-such-callable"),
    case(["trace", "tests.reliability.hostile_models:NOT_CALLABLE"], ERROR, "no callable 'NOT_CALLABLE'",
         id="not-callable"),
    case(["trace", "tests.reliability.hostile_models:raises"], ERROR, "hostile_models.raises()", "RuntimeError",
         "the weights file is missing", id="callable-raises"),
    case(["trace", "tests.reliability.hostile_models:returns_a_list"], ERROR, "returned list", "nn.Module",
         id="callable-returns-no-module"),
    case(["trace", "tests.reliability.hostile_models:no_inputs"], ERROR, "without example inputs",
         id="callable-returns-no-inputs"),
    case(["bench", "tests.fixtures_models:make_mlp"], ERROR, "zoo:NAME", "wrapopt trace --list", id="bench-not-zoo"),
]


@pytest.mark.parametrize("argv, code, fragments", NUMBERS)
def test_numbers(argv, code, fragments, capsys):
    assert_cli_refuses(argv, code, fragments, capsys)


@pytest.mark.parametrize("argv, code, fragments", BUDGETS)
def test_memory_budgets(argv, code, fragments, capsys):
    assert_cli_refuses(argv, code, fragments, capsys)


@pytest.mark.parametrize("argv, code, fragments", SOURCES)
def test_model_sources(argv, code, fragments, capsys):
    assert_cli_refuses(argv, code, fragments, capsys)


def test_trace_list_names_the_zoo(capsys):
    """The pointer the MODEL errors give exists: ``wrapopt trace --list`` lists the zoo."""
    from wrapopt.cli.main import main
    from wrapopt.models import zoo

    assert main(["trace", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"zoo:{name}" in out for name in zoo.ZOO)
