"""Trials/s of `wrapopt search --storage`: a fresh study against one killed with SIGKILL and resumed.

Usage (from the repository root; issue 33):
    PYTHONPATH=$PWD python scripts/resume_rate.py .journal 200 60 tpe [zoo:gpt-tiny]
arguments: storage suffix (.journal or .db), trials, trials finished before the kill, sampler.
Prints each process's trials/s (start-up included) and the rate between trial completion times.
Not a test: a measurement (timings depend on the machine)."""
import os, signal, subprocess, sys, time, tempfile
import optuna
from optuna.trial import TrialState
sys.path.insert(0, os.getcwd())
from wrapopt.search.study.run import open_storage, storage_url
optuna.logging.set_verbosity(optuna.logging.WARNING)
ext, trials, kill_at, sampler = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model = sys.argv[5] if len(sys.argv) > 5 else "zoo:gpt-tiny"
d = tempfile.mkdtemp()
def cmd(path, n):
    return [sys.executable, "-m", "wrapopt.cli", "search", model, "--world-size", "16", "--gpus-per-node", "8",
            "--trials", str(n), "--storage", path, "--study-name", "s", "--sampler", sampler, "--seed", "1"]
def finished(path):
    try:
        st = optuna.load_study(study_name="s", storage=open_storage(storage_url(path)))
    except Exception:
        return []
    return st.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
def rate(path):
    ts = sorted(finished(path), key=lambda t: t.datetime_complete)
    return ts
env = dict(os.environ, PYTHONPATH=os.getcwd())
fresh = os.path.join(d, "fresh" + ext)
t0 = time.monotonic()
subprocess.run(cmd(fresh, trials), env=env, stdout=subprocess.DEVNULL, check=True)
el = time.monotonic() - t0
print(f"fresh process: {trials} trials in {el:.1f} s: {trials / el:.2f} trials/s")
ts = rate(fresh)
late = [t for t in ts if t.number >= kill_at]
span = (late[-1].datetime_complete - late[0].datetime_complete).total_seconds()
print(f"fresh: {len(ts)} trials; trials {kill_at}..{trials}: {(len(late)-1)/span:.2f} trials/s")
killed = os.path.join(d, "killed" + ext)
p = subprocess.Popen(cmd(killed, trials), env=env, stdout=subprocess.DEVNULL)
while len(finished(killed)) < kill_at:
    time.sleep(0.05)
os.kill(p.pid, signal.SIGKILL); p.wait()
n0 = len(finished(killed))
t0 = time.monotonic()
subprocess.run(cmd(killed, trials), env=env, stdout=subprocess.DEVNULL, check=True)
el = time.monotonic() - t0
print(f"resumed process: {trials - n0} trials in {el:.1f} s: {(trials - n0) / el:.2f} trials/s")
ts = rate(killed)
late = [t for t in ts if t.number >= n0 + 1]
span = (late[-1].datetime_complete - late[0].datetime_complete).total_seconds()
print(f"resumed after kill -9 at {n0}: {len(ts)} trials; trials {n0+1}..: {(len(late)-1)/span:.2f} trials/s")
states = {}
st = optuna.load_study(study_name="s", storage=open_storage(storage_url(killed)))
for t in st.get_trials(deepcopy=False):
    states[t.state.name] = states.get(t.state.name, 0) + 1
print("states", states)
