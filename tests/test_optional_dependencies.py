"""pyzmq is the `precise` extra's: everything else runs without it, and what needs it says which
extra to install. Checked in a subprocess whose imports of ``zmq`` fail, as on a base install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

WITHOUT_ZMQ = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class NoZmq(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "zmq" or name.startswith("zmq."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoZmq())
    """
)

CHECKS = textwrap.dedent(
    """
    import contextlib, io

    import kvroute.cli, loadtest.demo, loadtest.sim.fleet, router.http.app, router.http.server
    from loadtest.sim.engine import SimEngine
    from router.config import ConfigError, config_from_dict

    with contextlib.redirect_stdout(io.StringIO()):
        assert kvroute.cli.main(["simulate", "--limit", "30", "--policy", "prefix_aware"]) == 0
    approximate = config_from_dict({"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]})
    router.http.app.build_app(approximate)
    SimEngine()
    assert "zmq" not in sys.modules
    try:
        config_from_dict({
            "backends": [{"name": "a", "url": "http://127.0.0.1:1"}],
            "index": {"mode": "events", "tokenizer": {"kind": "chunk"}},
        })
    except ConfigError as exc:
        print("config:", exc)
    try:
        SimEngine(kv_events="vllm")
    except RuntimeError as exc:
        print("sim:", exc)
    """
)


def test_the_base_install_runs_without_pyzmq_and_precise_mode_names_the_extra():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_ZMQ + CHECKS], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":", 1)[0] for line in lines] == ["config", "sim"]
    assert all("pyzmq" in line and "kvroute[precise]" in line for line in lines)
