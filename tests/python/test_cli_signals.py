"""How a kvh command unwinds on signals (kvh_cache._cli_signals): a Ctrl-C
or SIGTERM that Python drops (raised inside a finaliser or a weakref
callback) is sent again and ends the command as any other would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A command whose collected object raises its signal inside __del__ (as a
# handler does when the signal lands there), then goes on with `{after}`:
# without a second delivery it runs to the end and exits 0.
_SCRIPT = """
import signal, sys, threading, time
from kvh_cache import cli

class Bomb:
    def __del__(self):
        signal.raise_signal(signal.{sig})

def work(args):
    Bomb()
    {after}
    print("ran on")
    return 0

cli.cmd_doctor = work
t0 = time.monotonic()
rc = cli.main(["doctor"])
print(f"took {{time.monotonic() - t0:.2f}}", file=sys.stderr)
sys.exit(rc)
"""

_AFTER = {
    # polls: the signal comes back at its next check
    "busy": "deadline = time.monotonic() + 5\n    while time.monotonic() < deadline:\n        time.sleep(0.01)",
    # blocks: a real signal ends the wait, as the first one would have
    "waiting": "threading.Event().wait(5)",
    # returns at once: the signal still on its way is raised there
    "returning": "pass",
}


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH", "")) if p)
    return env


def _default_signals():
    # A runner in the background ignores SIGINT; its children inherit that.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def _run_script(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
        env=_env(),
        preexec_fn=_default_signals,
    )


def _run(sig: str, after: str) -> subprocess.CompletedProcess:
    return _run_script(_SCRIPT.format(sig=sig, after=_AFTER[after]))


@pytest.mark.parametrize(
    "sig, rc, message",
    [
        ("SIGINT", 130, "kvh: interrupted"),
        ("SIGTERM", 143, "kvh: stopped by signal 15 (SIGTERM)"),
        ("SIGHUP", 129, "kvh: stopped by signal 1 (SIGHUP)"),
    ],
)
@pytest.mark.parametrize("after", sorted(_AFTER))
def test_a_signal_dropped_in_a_finalizer_still_ends_the_command(sig, rc, message, after):
    res = _run(sig, after)
    ran_on = "ran on\n" if after == "returning" else ""  # its work was done when the signal came back
    assert res.returncode == rc and res.stdout == ran_on, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[:-1] == [message] and lines[-1].startswith("took "), res.stderr
    assert float(lines[-1].split()[1]) < 2.5, res.stderr


def test_other_exceptions_in_finalizers_are_still_reported():
    script = """
    import sys
    from kvh_cache import cli

    class Broken:
        def __del__(self):
            raise ValueError("reported as before")

    def work(args):
        Broken()
        print("ran on")
        return 0

    cli.cmd_doctor = work
    sys.exit(cli.main(["doctor"]))
    """
    res = _run_script(script)
    assert res.returncode == 0 and res.stdout == "ran on\n", res.stdout + res.stderr
    assert "Exception ignored" in res.stderr and "reported as before" in res.stderr, res.stderr


# A library that catches every exception and raises its own in its place,
# without a cause, as pydantic does when a signal lands while it builds a
# validator (Qdrant's client is imported that way during the demo).
_WRAPPING_SCRIPT = """
import asyncio, signal, sys
from kvh_cache import cli

def library_call():
    try:
        signal.raise_signal(signal.{sig})
    except BaseException as exc:
        raise {wrapper}(f"building a validator: {{exc!r}}") from None

def work(args):
    library_call()
    print("ran on")
    return 0

cli.cmd_doctor = work
sys.exit(cli.main(["doctor"]))
"""


@pytest.mark.parametrize(
    "sig, rc, message",
    [
        ("SIGINT", 130, "kvh: interrupted"),
        ("SIGTERM", 143, "kvh: stopped by signal 15 (SIGTERM)"),
        ("SIGHUP", 129, "kvh: stopped by signal 1 (SIGHUP)"),
    ],
)
# RuntimeError escapes; ValueError is reported as a usage error; the other
# two are no Exception (asyncio's cancellation, a library's own exit).
@pytest.mark.parametrize("wrapper", ["RuntimeError", "ValueError", "asyncio.CancelledError", "SystemExit"])
def test_a_signal_wrapped_by_a_library_still_ends_the_command_as_that_signal(sig, rc, message, wrapper):
    res = _run_script(_WRAPPING_SCRIPT.format(sig=sig, wrapper=wrapper))
    assert res.returncode == rc and res.stdout == "", res.stdout + res.stderr
    assert "Traceback" not in res.stderr and res.stderr.strip().splitlines()[-1] == message, res.stderr


def test_an_error_raised_without_a_signal_is_still_a_traceback():
    script = _WRAPPING_SCRIPT.replace("signal.raise_signal(signal.{sig})", "raise OSError('not a signal')")
    res = _run_script(script.format(wrapper="RuntimeError"))
    assert res.returncode == 1 and "Traceback" in res.stderr, res.stdout + res.stderr
    assert "RuntimeError: building a validator: OSError('not a signal')" in res.stderr, res.stderr


# How a command that caught its own Ctrl-C and went on then ends: the code
# after the caught interrupt, the exit status, and standard error's lines.
_AFTER_CAUGHT = {
    "error": ("raise RuntimeError('a failure of its own')", 130, ["RuntimeError: a failure of its own", "interrupted"]),
    "exit 0": ("sys.exit(0)", 0, []),
    "exit None": ("sys.exit()", 0, []),
    "exit message": ("sys.exit('config broken')", 130, ["config broken", "interrupted"]),
    "exit 3": ("sys.exit(3)", 130, ["exit status 3", "interrupted"]),
    "str fails": (
        "class Bad(Exception):\n        def __str__(self):\n            raise ValueError('no str')\n    raise Bad()",
        130,
        ["Bad", "interrupted"],
    ),
    "long message": (
        "raise RuntimeError('\\n' + 'x' * 200000 + '\\nmore')",
        130,
        ["RuntimeError: " + "x" * 500, "interrupted"],
    ),
}


@pytest.mark.parametrize("ending", sorted(_AFTER_CAUGHT))
def test_how_a_command_ends_after_it_caught_an_interrupt(ending):
    # The failure is shown (one line, no traceback) and the command ends
    # as interrupted, which is what its caller asked for; a clean exit is
    # a clean exit.
    code, rc, lines = _AFTER_CAUGHT[ending]
    script = _WRAPPING_SCRIPT.replace(
        "def work(args):\n    library_call()",
        "def work(args):\n    try:\n        signal.raise_signal(signal.SIGINT)\n    except KeyboardInterrupt:\n"
        "        pass\n    " + code,
    )
    res = _run_script(script.format(sig="SIGINT", wrapper="RuntimeError"))
    assert res.returncode == rc and "Traceback" not in res.stderr, res.stdout + res.stderr[:2000]
    assert res.stderr.splitlines() == ["kvh: " + line for line in lines], res.stderr[:2000]
