"""The examples as a user runs them: every config loads; the digits ones train with the console command."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import run_cli  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
COMMAND = str(Path(sys.executable).with_name("lightning-decentral"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.stem)
def test_config_loads(config: Path, run_cli, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.chdir(ROOT)  # the configs name the example classes from the repository root
    code, out, err = run_cli(["fit", "--config", str(config), "--print_config"])
    assert code == 0, err[-3000:]
    assert "class_path: examples." in out and "strategy:" in out


def fit(tmp_path: Path, config: str, *overrides: str) -> str:
    """``lightning-decentral fit --config examples/configs/CONFIG`` from a copy of the repository root's layout."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    done = subprocess.run(
        [COMMAND, "fit", "--config", f"examples/configs/{config}", *overrides],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert done.returncode == 0, first_and_last_errors(done.stderr)
    return done.stdout


def first_and_last_errors(stderr: str) -> str:
    """The first traceback (the rank that failed first: the cause), then the end of the output."""
    first = stderr.find("Traceback")
    return (stderr[first : first + 4000] + "\n[...]\n" if first >= 0 else "") + stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)  # 4 processes; the suite may share the cores with other work
def test_quickstart_reaches_90_percent_and_says_where_logs_and_plots_are(tmp_path: Path) -> None:
    out = fit(tmp_path, "digits_dpsgd.yaml")  # README command 1, verbatim
    assert "on 4 workers (dpsgd awc, Ring(world_size=4))" in out
    accuracy = re.search(r"Validation of the averaged model x̄: .*val_acc = ([0-9.]+)", out)
    assert accuracy, out[-3000:]
    assert float(accuracy.group(1)) >= 0.90
    logs = re.search(r"Logs \(CSVLogger\): (\S+)", out)
    assert logs and (tmp_path / logs.group(1) / "metrics.csv").is_file(), out[-3000:]
    assert re.search(r"Logs \(TensorBoardLogger\): \S+", out)
    plots = re.search(r"Plots \(\d+\) in (\S+): (.+)", out)
    assert plots, out[-3000:]
    for name in plots.group(2).split(", "):
        assert (tmp_path / plots.group(1) / name).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", ["digits_decentlam.yaml", "digits_ddp.yaml"])
def test_digits_config_trains_a_few_steps(tmp_path: Path, config: str) -> None:
    # 2 workers, no loggers (hence no plots): the quickstart test covers those; this one the configs
    out = fit(tmp_path, config, "--trainer.max_steps", "3", "--trainer.devices", "2", "--trainer.logger", "false")
    assert "Finished fit after 3 steps on 2 workers" in out, out[-3000:]
    assert re.search(r"Validation of the (averaged )?model.*: .*val_acc = [0-9.]+", out), out[-3000:]


def test_docs_topology_table_is_what_the_code_computes() -> None:
    spec = importlib.util.spec_from_file_location("docs_topologies", ROOT / "docs" / "scripts" / "topologies.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert (ROOT / "docs" / "topologies_table.md").read_text() == generator.table(), (
        "the topologies changed: run `python docs/scripts/topologies.py` and commit docs/"
    )


@pytest.mark.slow
def test_simulated_config_trains_in_this_process(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The YAML with SimulatedDecentralizedStrategy by class_path: a few steps of 16 workers, in one process."""
    from lightning_decentral.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lightning-decentral"])
    main(
        [
            "fit",
            "--config",
            "examples/configs/digits_simulated.yaml",
            "--trainer.max_steps",
            "3",
            "--trainer.logger",
            "false",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert "Finished fit after 3 steps on 16 workers (dpsgd awc, Ring(world_size=16), simulated in one process)" in out
    assert "Validation of the averaged model x̄" in out


@pytest.mark.slow
def test_digits_datamodule_gives_each_worker_a_dirichlet_shard(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`dirichlet_alpha` from the command line (as from YAML): 16 simulated workers on label-skewed shards."""
    from examples.digits import DigitsDataModule
    from lightning_decentral import DirichletSampler
    from lightning_decentral.cli import main

    data = DigitsDataModule(dirichlet_alpha=0.1, seed=3)
    data.setup("fit")
    sampler = data.train_dataloader().sampler
    assert isinstance(sampler, DirichletSampler) and sampler.alpha == 0.1 and sampler.seed == 3
    labels = [int(data.train_set[i][1]) for i in sampler.shard.tolist()]
    assert labels == sampler.labels[sampler.shard].tolist()  # the labels of the training split, in its order
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lightning-decentral"])
    main(
        [
            "fit",
            "--config",
            "examples/configs/digits_simulated.yaml",
            "--data.init_args.dirichlet_alpha",
            "0.1",
            "--trainer.max_steps",
            "2",
            "--trainer.logger",
            "false",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.callbacks",
            "[]",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    assert "Finished fit after 2 steps on 16 workers" in capsys.readouterr().out
