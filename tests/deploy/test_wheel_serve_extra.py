"""`pip install tandem[serve]` brings what the served API needs, xgrammar included: the wheel
is built, installed with its `serve` extra into a fresh virtual environment, and that install
answers a JSON-schema request.

To stay fast, the fresh environment sees this environment's packages the way a
`--system-site-packages` venv sees the system's (a `.pth` naming a folder of links, placed
after the venv's own site-packages), except tandem itself and xgrammar: pip must install those
two from the wheel's metadata, into the venv. pip never removes a package outside the venv, and
the test checks that no second torch was installed (xgrammar asks for `torch>=1.10`, which the
local CPU torch satisfies).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# What the wheel is built from (pyproject's packages.find and package-data).
_SOURCES = ("pyproject.toml", "tandem", "tandem_kernels", "tandem_services", "tandem_protos")
# Distributions the fresh venv must install itself (name prefixes in site-packages).
_NOT_SHARED = ("tandem", "__editable__", "xgrammar")

_CHECK = r"""
import json, sys
from pathlib import Path

import torch, xgrammar
import tandem
from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams

venv = Path(sys.prefix).resolve()
where = {m.__name__: str(Path(m.__file__).resolve()) for m in (tandem, xgrammar, torch)}
schema = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
# The torch backend, eager: no C++ kernel build or graph capture in this fresh install.
llm = LLM(
    model=sys.argv[1], device="cpu", dtype="float32", max_model_len=256, num_threads=1,
    attention_backend="torch", enforce_eager=True, num_gpu_blocks=64, max_num_seqs=2,
)
params = SamplingParams(
    temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema)
)
out = llm.generate(["The weather in Paris today, as JSON:"], params, use_tqdm=False)[0]
llm.shutdown()
print(json.dumps({"venv": str(venv), "where": where, "text": out.outputs[0].text,
                  "finish_reason": out.outputs[0].finish_reason}))
"""


def _run(argv: list[str], cwd: Path, timeout_s: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, f"{argv[:4]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _share_site_packages(venv_python: Path, tmp: Path) -> None:
    """Make this environment's packages, but tandem and xgrammar, visible to the venv."""
    shared = tmp / "shared-site"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if name.startswith(_NOT_SHARED) or name.endswith(".pth"):
            continue
        (shared / entry.name).symlink_to(entry)
    site = _run(
        [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp
    )
    (Path(site.strip()) / "zz_shared_site.pth").write_text(f"{shared}\n")


def test_serve_extra_installs_a_wheel_that_answers_a_json_schema(
    tmp_path: Path, smollm2_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in _SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(src),
        ],
        tmp_path,
    )
    (wheel,) = dist.glob("tandem-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    _share_site_packages(python, tmp_path)
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", f"{wheel}[serve]"],
        tmp_path,
        timeout_s=600,
    )
    report = json.loads(_run([str(python), "-c", _CHECK, str(smollm2_path)], tmp_path))

    venv_root = Path(report["venv"])
    where = {k: Path(v) for k, v in report["where"].items()}
    # tandem and xgrammar came with the wheel and its extra; torch is still the shared one.
    assert where["tandem"].is_relative_to(venv_root), where
    assert where["xgrammar"].is_relative_to(venv_root), where
    assert not where["torch"].is_relative_to(venv_root), where
    site = next(venv_root.glob("lib/python*/site-packages"))
    assert not list(site.glob("torch*")), "the serve extra installed a second torch"
    answer = json.loads(report["text"])
    assert set(answer) == {"city", "sunny"}, report["text"]
    assert isinstance(answer["city"], str) and isinstance(answer["sunny"], bool)
    assert report["finish_reason"] == "stop"
