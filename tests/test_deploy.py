"""deploy/ recipes: every YAML parses, every birdzarr command they run exists, train.py trains.

Docker, SLURM and Kubernetes cannot run here; these checks keep the recipes honest instead.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import birdzarr
from birdzarr.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
RECIPES = [*sorted(p for p in DEPLOY.iterdir() if p.is_file() and p.suffix != ".py"),
           ROOT / "docs" / "deploy.md"]
# "birdzarr SUBCOMMAND" in a shell line, a YAML string or a doc's code block (not s3://birdzarr/...)
_INVOCATION = re.compile(r"(?:^|[\s\"'\[;&|(`])birdzarr[ \t]+([a-z][a-z0-9-]*)", re.M)


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(action.choices)  # type: ignore[arg-type]


def yaml_documents() -> list[tuple[Path, Any]]:
    return [(path, doc) for path in sorted(DEPLOY.glob("*.y*ml"))
            for doc in yaml.safe_load_all(path.read_text())]


def test_every_yaml_file_parses() -> None:
    docs = yaml_documents()
    assert {p.name for p, _ in docs} >= {"docker-compose.yml", "k8s-job.yaml"}
    assert all(doc for _, doc in docs)


def test_every_birdzarr_command_in_the_recipes_exists() -> None:
    known = subcommands()
    used: dict[str, set[str]] = {}
    for path in RECIPES:
        text = path.read_text()
        if path.suffix == ".md":  # commands in a doc live in its code blocks
            text = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, re.S))
        else:  # comments are prose
            text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        for name in _INVOCATION.findall(text):
            used.setdefault(name, set()).add(path.name)
    assert {"copy", "convert", "info"} <= set(used)
    missing = {name: files for name, files in used.items() if name not in known}
    assert not missing, f"recipes use commands the CLI does not have: {missing}"


def _argv(container: dict[str, Any]) -> list[str]:
    def as_list(value: Any) -> list[str]:
        return shlex.split(value) if isinstance(value, str) else [str(v) for v in value or []]

    return as_list(container.get("entrypoint", container.get("command"))) + as_list(
        container.get("command") if "entrypoint" in container else container.get("args")
    )


def test_containers_run_existing_commands_and_scripts() -> None:
    """Containers without an entrypoint override run the image's `birdzarr` entry point."""
    known = subcommands()
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    job = yaml.safe_load((DEPLOY / "k8s-job.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    containers = [s for s in compose["services"].values() if "birdzarr" in s.get("image", "")]
    containers += [{**c, "image": c["image"]} for c in pod["containers"] + pod.get("initContainers", [])]
    checked = 0
    for container in containers:
        argv = _argv(container)
        if not argv or argv[0] not in ("python", "sh", "bash"):  # the birdzarr entry point
            assert argv and argv[0] in known, container
            checked += 1
        elif argv[0] == "python":
            assert argv[1] == "/opt/birdzarr/train.py", argv  # where the Dockerfile puts it
            checked += 1
    assert checked >= 3
    assert "COPY deploy/train.py /opt/birdzarr/train.py" in (DEPLOY / "Dockerfile").read_text()


def test_credentials_come_from_secrets_not_files() -> None:
    job = yaml.safe_load((DEPLOY / "k8s-job.yaml").read_text())
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name] and env[name]["valueFrom"]["secretKeyRef"]["name"] == "birdzarr-s3"


def test_dockerfile_defaults_to_cpu_and_takes_a_cuda_base() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11", text, re.M) and "FROM ${BASE_IMAGE}" in text
    assert "whl/cpu" in text and 'ENTRYPOINT ["birdzarr"]' in text
    for source in re.findall(r"^COPY (\S+) ", text, re.M) + ["pyproject.toml", "README.md"]:
        assert (ROOT / source).exists(), source


def test_slurm_script_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(DEPLOY / "slurm.sbatch")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_train_script_runs_one_short_epoch(small_store: birdzarr.Store) -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, str(DEPLOY / "train.py"), small_store.location.path, "--epochs", "1",
         "--batch-size", "8192", "--workers", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"epoch 0: 30,000 windows", done.stdout), done.stdout


@pytest.mark.slow
def test_train_script_runs_two_epochs_with_persistent_workers(small_store: birdzarr.Store) -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, str(DEPLOY / "train.py"), small_store.location.path, "--epochs", "2",
         "--batch-size", "4096", "--workers", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert len(re.findall(r"epoch [01]: 30,000 windows", done.stdout)) == 2, done.stdout


def test_recipes_train_on_a_shuffled_store() -> None:
    """The docs say the recipes' store is a --shuffle conversion; compose converts it so."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert "--shuffle" in " ".join(compose["services"]["convert"]["command"])
    assert "--shuffle" in (ROOT / "docs" / "deploy.md").read_text()
