"""The switch reaches Ray workers on a cluster started with `ray start`, where workers are not the driver's children.

A real local cluster (`ray start --head --block`, one CPU) runs in its own
process group; a driver subprocess sets the variables, builds its runtime env
as verl's `main_ppo` does, and asks a worker actor that imports verl which mode
it resolves. The control run loads no plugin in the driver and shows that the
variable does not reach the worker by itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from verl_fused_hook.verl_integration.ray_env import FORWARDED_ENV, forwarded_env

REPO = Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent(
    """
    import json, os
    import ray
    import verl  # loads the plugin through verl's entry points (unless VERL_USE_EXTERNAL_PLUGINS=none)
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo import get_ppo_ray_runtime_env  # the name main_ppo.run_ppo calls

    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(None), {})  # run_ppo merges ray_init.runtime_env on top
    ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=OmegaConf.to_container(runtime_env))

    @ray.remote
    class Worker:
        def report(self):
            import verl  # noqa: F401  (the plugin loads here as in every verl worker)
            from verl_fused_hook.switch import resolve_plan

            names = ("VERL_FUSED_USE_OP_HOOK", "VERL_FUSED_HOOK_LOGGING_LEVEL")
            return {"env": {name: os.environ.get(name) for name in names}, "mode": resolve_plan(None).mode,
                    "pid": os.getpid(), "ppid": os.getppid()}

    report = ray.get(Worker.remote().report.remote(), timeout=240)
    report["driver_pid"] = os.getpid()
    print("REPORT " + json.dumps(report))
    ray.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _clean_env() -> dict[str, str]:
    env = {
        name: value for name, value in os.environ.items() if name not in FORWARDED_ENV and not name.startswith("RAY_")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def ray_cluster():
    """`ray start --head` in its own process group, started without any of our variables; killed by group id."""
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="vfh-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [
            str(ray_cli),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=1",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env=_clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert head.poll() is None, "ray start --head exited early"
            time.sleep(1)
        else:
            pytest.fail("ray start --head did not open its port within 120 s")
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        time.sleep(2)  # let the raylet's children see the group signal
        try:
            os.killpg(head.pid, signal.SIGKILL)  # anything of this group still alive
        except ProcessLookupError:
            pass


def _run_driver(address: str, **extra_env: str) -> dict:
    import json

    env = {**_clean_env(), "RAY_ADDRESS": address, **extra_env}
    result = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=400)
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT ") :])


def test_forwarded_env_takes_only_our_variables_as_strings():
    environ = {"VERL_FUSED_USE_OP_HOOK": "1", "VERL_FUSED_HOOK_LOGGING_LEVEL": "DEBUG", "OTHER": "x"}
    assert forwarded_env(environ) == {"VERL_FUSED_USE_OP_HOOK": "1", "VERL_FUSED_HOOK_LOGGING_LEVEL": "DEBUG"}
    assert forwarded_env({}) == {}


def test_switch_reaches_a_worker_on_a_ray_start_cluster(ray_cluster):
    report = _run_driver(ray_cluster, VERL_FUSED_USE_OP_HOOK="1", VERL_FUSED_HOOK_LOGGING_LEVEL="DEBUG")
    assert report["ppid"] != report["driver_pid"]
    assert report["env"] == {"VERL_FUSED_USE_OP_HOOK": "1", "VERL_FUSED_HOOK_LOGGING_LEVEL": "DEBUG"}
    assert report["mode"] == "hook"


def test_without_the_plugin_in_the_driver_the_variable_stays_behind(ray_cluster):
    """Control: the cluster does not hand the driver's environment to workers by itself."""
    report = _run_driver(ray_cluster, VERL_FUSED_USE_OP_HOOK="1", VERL_USE_EXTERNAL_PLUGINS="none")
    assert report["env"]["VERL_FUSED_USE_OP_HOOK"] is None
    assert report["mode"] == "unset"
