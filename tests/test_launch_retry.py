"""The test harness's one retry (``conftest.run_script``): a launch that a crash in native code ended - a
segmentation fault or glibc's abort on a corrupted heap, in its own process or in another rank's that it then failed
for - runs once more with a warning; a second one, another abort, or a Python error fails the test. And the run
scripts' error records (``toy.outcome``): a lost peer ends the launch instead of becoming a case's result."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_script
from toy import outcome

# Crashes (SIGSEGV) while ``marker`` holds fewer than ``crashes`` lines, adding one per crash; then prints "ran".
SCRIPT = """
import os, signal, sys
marker, crashes = sys.argv[1], int(sys.argv[2])
count = len(open(marker).read().splitlines()) if os.path.exists(marker) else 0
if count < crashes:
    open(marker, "a").write("crash\\n")
    os.kill(os.getpid(), signal.SIGSEGV)
print("ran")
"""


# A "rank" that starts a child which crashes (faulthandler prints its banner) while the marker holds fewer than
# ``crashes`` lines, then fails as a run script does on a lost peer.
TWO_RANKS = """
import os, subprocess, sys
marker, crashes = sys.argv[1], int(sys.argv[2])
count = len(open(marker).read().splitlines()) if os.path.exists(marker) else 0
if count < crashes:
    open(marker, "a").write("crash\\n")
    child = "import ctypes, faulthandler; faulthandler.enable(); ctypes.string_at(0)"
    subprocess.run([sys.executable, "-c", child])
    raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1215")
print("ran")
"""


def _script(tmp_path: Path, text: str = SCRIPT) -> str:
    path = tmp_path / "crashing.py"
    path.write_text(text)
    return str(path)


def test_a_launch_ended_by_a_segfault_runs_once_more_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="ended by a crash in native code"):
        out = run_script(_script(tmp_path), str(tmp_path / "marker"), "1")
    assert out.strip() == "ran"
    assert (tmp_path / "marker").read_text().count("crash") == 1


def test_a_launch_failed_by_another_ranks_segfault_runs_once_more(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="ended by a crash in native code"):
        out = run_script(_script(tmp_path, TWO_RANKS), str(tmp_path / "marker"), "1")
    assert out.strip() == "ran"
    assert (tmp_path / "marker").read_text().count("crash") == 1


# Aborts as glibc does on a corrupted heap (its message, then SIGABRT) the first time, or with another message always.
ABORTING = """
import os, sys
marker, message = sys.argv[1], sys.argv[2]
if not os.path.exists(marker) or message != "malloc_consolidate(): unaligned fastbin chunk detected":
    open(marker, "a").write("crash\\n")
    print(message, file=sys.stderr, flush=True)
    os.abort()
print("ran")
"""


def test_glibcs_abort_on_a_corrupted_heap_runs_once_more(tmp_path: Path) -> None:
    message = "malloc_consolidate(): unaligned fastbin chunk detected"
    with pytest.warns(UserWarning, match="ended by a crash in native code"):
        out = run_script(_script(tmp_path, ABORTING), str(tmp_path / "marker"), message)
    assert out.strip().endswith("ran")


def test_another_abort_is_not_retried(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="exited with -6"):
        run_script(_script(tmp_path, ABORTING), str(tmp_path / "marker"), "terminate called after throwing")
    assert (tmp_path / "marker").read_text().count("crash") == 1


def test_a_second_segfault_fails(tmp_path: Path) -> None:
    with (
        pytest.warns(UserWarning, match="ended by a crash in native code"),
        pytest.raises(pytest.fail.Exception, match="exited with"),
    ):
        run_script(_script(tmp_path), str(tmp_path / "marker"), "2")
    assert (tmp_path / "marker").read_text().count("crash") == 2


def test_a_python_error_is_not_retried(tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text("open('" + str(tmp_path / "runs") + "', 'a').write('x'); raise SystemExit(3)")
    with pytest.raises(pytest.fail.Exception, match="exited with 3"):
        run_script(str(script))
    assert (tmp_path / "runs").read_text() == "x"


def test_a_lost_peer_ends_the_launch_instead_of_becoming_a_result() -> None:
    assert outcome(int, "x") == "ValueError: invalid literal for int() with base 10: 'x'"
    assert outcome(int, "1") == "ok"
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        outcome(_raise, RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1215. This is typically..."))


def _raise(error: Exception) -> None:
    raise error
