"""scripts/request_files.py, the tracer docs/architecture.md's file count comes from: its hook records what a process
of this checkout calls (and only this checkout's packages), and a file counts for the request only where it was
called inside the request's window."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("request_files", ROOT / "scripts" / "request_files.py")
assert _spec is not None and _spec.loader is not None
request_files = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(request_files)


def test_the_hook_records_the_functions_a_process_of_this_checkout_calls_and_nothing_outside_its_packages(tmp_path):
    request_files.write_hook(tmp_path)
    code = "import json; from contracts.sampling import seed_for_image; json.dumps(seed_for_image(1, 2))"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)
    ticks = request_files.ticks_by_function(tmp_path)
    assert (str(ROOT / "contracts" / "sampling.py"), "seed_for_image") in ticks  # written at exit, between dumps
    assert all(Path(name).relative_to(ROOT).parts[0] in request_files.PACKAGES for name, _ in ticks)
    assert not any(function == "dumps" for _, function in ticks)  # the standard library's calls are not recorded


def test_a_file_counts_where_called_in_the_window_in_the_order_first_called_and_idle_callers_are_marked():
    ticks = {
        ("b.py", "late"): {105, 130},
        ("a.py", "early"): {120, 101},  # unordered, as merged sets are: the first call is the smallest tick
        ("a.py", "other"): {140},
        ("poll.py", "tick"): {50, 110},  # also called while idle
        ("before.py", "f"): {10},  # called before the request only
    }
    called, idle, functions = request_files.called_during(ticks, window=range(100, 150), idle=range(40, 100))
    assert called == ["a.py", "b.py", "poll.py"]
    assert idle == {"poll.py"}
    assert sorted(functions["a.py"]) == ["early", "other"]
