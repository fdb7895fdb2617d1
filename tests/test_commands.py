"""The command lines: ``ratel-convert`` (and ``python -m lightning_ratel.convert``) and the examples' ``--help``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ratel_cli import estimate
from tests.models import tiny_llama

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=240)


def test_convert_console_script_helps_without_importing_lightning() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["ratel-convert"].split(":")
    code = "\n".join([
        "import sys",
        f"from {module} import {function} as main",
        "try:",
        "    main(['--help'])",
        "except SystemExit as e:",
        "    assert e.code == 0, e.code",
        "assert 'lightning' not in sys.modules and 'torch' not in sys.modules",
    ])
    done = run("-c", code)
    assert done.returncode == 0, done.stderr
    assert "usage: ratel-convert" in done.stdout and "--swap SWAP_DIR" in done.stdout


def test_convert_module_runs_without_runpy_warning() -> None:
    done = run("-m", "lightning_ratel.convert", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: python -m lightning_ratel.convert" in done.stdout
    assert "RuntimeWarning" not in done.stderr, done.stderr


def test_convert_usage_error() -> None:
    done = run("-m", "lightning_ratel.convert", "out")
    assert done.returncode == 2
    assert "give a sharded checkpoint directory" in done.stderr


@pytest.mark.parametrize("example", ["finetune_pretrained.py", "beyond_ram.py"])
def test_example_help_shows_every_default(example: str) -> None:
    done = run(str(REPO / "examples" / example), "--help")
    assert done.returncode == 0, done.stderr
    options = done.stdout[done.stdout.index("options:"):]
    assert "decoder layers (default: 28)" in " ".join(options.split())
    # Every option but -h says what it is and what it defaults to.
    described = [line for line in options.splitlines()[1:] if line.lstrip().startswith("--")]
    assert " ".join(options.split()).count("(default:") == len(described)


def test_estimate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``ratel-estimate`` on a Hugging Face folder: run as a command once, then called in this process."""
    tiny_llama().save_pretrained(tmp_path / "hf")
    done = run("-c", f"import lightning_ratel_cli as c; raise SystemExit(c.estimate([{str(tmp_path / 'hf')!r}, "
                     "'--param-cache', 'ssd', '--precision', '32-true']))")
    assert done.returncode == 0, done.stderr
    assert "disk (swap files)" in done.stdout and "param_cache: ssd" in done.stdout
    assert estimate([str(tmp_path / "hf"), "--param-cache", "host", "--ranks", "2", "--accumulate-grad-batches", "2",
                     "--gradient-exchange", "micro_batch"]) == 0
    assert "gradient exchange  micro_batch (asked for)" in capsys.readouterr().out
    # Several ranks on GPUs reduce on the device; on the CPU in host memory.
    assert estimate([str(tmp_path / "hf"), "--ranks", "2"]) == 0
    assert "gradient exchange  device (on the GPUs" in capsys.readouterr().out
    assert estimate([str(tmp_path / "hf"), "--ranks", "2", "--accelerator", "cpu"]) == 0
    assert "gradient exchange  window" in capsys.readouterr().out
    assert estimate([str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_example_module_reports_perplexity_under_ratel(tmp_path: Path) -> None:
    """The example LightningModule's torchmetrics perplexity works unchanged under RatelStrategy (the metric's state
    moves with the module) and is exp of the validation loss."""
    code = "\n".join([
        "import math, sys, torch, lightning as L",
        "sys.path.insert(0, 'examples')",
        "from lm_module import CausalLMModule",
        "from lightning_ratel import RatelStrategy",
        "module = CausalLMModule(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,",
        "                        max_seq_len=16)",
        "data = [{'input_ids': t, 'labels': t} for t in torch.randint(0, 64, (2, 4, 17))]",
        f"trainer = L.Trainer(accelerator='cpu', strategy=RatelStrategy(ssd_paths=[{str(tmp_path)!r}]),",
        "                    logger=False, enable_progress_bar=False, enable_model_summary=False)",
        "(metrics,) = trainer.validate(module, torch.utils.data.DataLoader(data, batch_size=None), verbose=False)",
        "assert math.isclose(metrics['val_perplexity'], math.exp(metrics['val_loss']), rel_tol=1e-4), metrics",
    ])
    done = run("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
