"""Every recipe of docs/recipes.md, run as the page says (with fewer workers or steps), and its outcome checked: it
trained (a finite loss below chance's, a checkpoint on disk), and what the recipe is about happened (the bytes
compression saves, DiLoCo's rounds, the resumed step, the survivors and the worker that rejoined, the plots)."""

from __future__ import annotations

import csv
import math
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_examples import ROOT, first_and_last_errors, fit

pytestmark = pytest.mark.slow  # every recipe trains; most start processes

CHANCE = math.log(10)  # the cross-entropy of a uniform guess over the 10 digits
TWO_WORKERS_ONE_EPOCH = (
    "--trainer.devices",
    "2",
    "--trainer.max_epochs",
    "1",
    "--trainer.enable_progress_bar",
    "false",
)


def run_module(cwd: Path, module: str, *args: str) -> str:
    """`python -m MODULE ARGS` from `cwd` (a directory that holds the repository's examples), bounded; its stdout."""
    if not (cwd / "examples").exists():
        (cwd / "examples").symlink_to(ROOT / "examples")
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, first_and_last_errors(done.stderr)
    return done.stdout


def run_in_process(module: str, args: list[str], monkeypatch: pytest.MonkeyPatch, cwd: Path) -> None:
    """`python -m MODULE ARGS` in this process (the one-process recipes: no second import of torch and Lightning)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [module, *args])
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:  # a command line's `sys.exit(main())`
        assert exit_.code in (0, None), exit_.code


def metric(rows: list[dict[str, str]], name: str) -> list[tuple[int, float]]:
    """`(step, value)` of a metric in a CSVLogger's rows, where logged."""
    return [(int(row["step"]), float(row[name])) for row in rows if row.get(name)]


def read_metrics(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def cli_report(out: str, tmp_path: Path) -> tuple[float, Path, Path]:
    """What `lightning-decentral fit` printed at the end: x̄'s validation loss, the CSV log, the checkpoint."""
    loss = re.search(r"Validation of the averaged model x̄: .*val_loss = ([0-9.]+)", out)
    logs = re.search(r"Logs \(CSVLogger\): (\S+)", out)
    checkpoint = re.search(r"Checkpoint: (\S+)", out)
    assert loss and logs and checkpoint, out[-3000:]
    return float(loss.group(1)), tmp_path / logs.group(1), tmp_path / checkpoint.group(1)


def assert_trained(loss: float, checkpoint: Path) -> None:
    assert math.isfinite(loss) and loss < CHANCE, loss
    assert checkpoint.is_file() and Path(f"{checkpoint}.shards").is_dir()  # x̄, and a shard per replica beside it


@pytest.mark.timeout(600)
def test_dpsgd_in_place_of_ddp(tmp_path: Path) -> None:
    out = run_module(tmp_path, "examples.recipes.dpsgd", "--devices", "2", "--max-steps", "20", "--root", "logs")
    report = re.search(r"dpsgd: 20 steps on 2 workers; val_acc = [0-9.]+, val_loss = ([0-9.]+); checkpoint: (\S+)", out)
    assert report, out[-3000:]
    assert_trained(float(report.group(1)), tmp_path / report.group(2))


@pytest.mark.timeout(600)
def test_decentlam(tmp_path: Path) -> None:
    out = fit(tmp_path, "digits_decentlam.yaml", "--trainer.devices", "2", "--trainer.max_epochs", "1")
    assert "Finished fit after 23 steps on 2 workers (decentlam, OnePeerExponential(world_size=2))" in out, out[-3000:]
    loss, _, checkpoint = cli_report(out, tmp_path)
    assert_trained(loss, checkpoint)


@pytest.mark.timeout(600)
def test_compression_cuts_the_bytes_25_fold(tmp_path: Path) -> None:
    from examples.digits import DigitsCNN

    out = fit(tmp_path, "digits_dpsgd.yaml", "--config", "examples/recipes/compression.yaml", *TWO_WORKERS_ONE_EPOCH)
    loss, logs, checkpoint = cli_report(out, tmp_path)
    assert_trained(loss, checkpoint)
    step, sent = metric(read_metrics(logs), "gossip/bytes_sent")[-1]  # bytes this worker sent by the end of `step`
    model_bytes = 4 * sum(p.numel() for p in DigitsCNN().parameters())  # float32, to its one neighbour per step
    assert 0 < sent / (step + 1) < model_bytes / 25  # `sign`: 1 bit a value and a scale per 1024


@pytest.mark.timeout(600)
def test_diloco_starts_every_round_from_one_model(tmp_path: Path) -> None:
    out = fit(tmp_path, "digits_dpsgd.yaml", "--config", "examples/recipes/diloco.yaml", *TWO_WORKERS_ONE_EPOCH)
    assert "(local steps with an outer optimizer, Complete(world_size=2))" in out, out[-3000:]
    loss, logs, checkpoint = cli_report(out, tmp_path)
    assert_trained(loss, checkpoint)
    distances = dict(metric(read_metrics(logs), "consensus/distance"))  # measured after steps 4, 9, 14, 19
    assert distances[9] == distances[19] == 0  # the outer steps (every 10): every worker restarts from θ
    assert distances[4] > 0 and distances[14] > 0  # the local steps in between move the replicas apart


@pytest.mark.timeout(300)
def test_simulation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    args = ["--workers", "4", "--max-steps", "10", "--root", "logs"]
    run_in_process("examples.recipes.simulate", args, monkeypatch, tmp_path)
    out = capsys.readouterr().out
    report = re.search(r"4 simulated workers, ring: 10 steps; val_acc of x̄ = ([0-9.]+); Ξ/‖x̄‖ = (\S+); log", out)
    assert report, out[-3000:]
    assert 0 < float(report.group(2)) < 1  # the replicas differ, and by less than their average's size
    rows = read_metrics(tmp_path / "logs" / "ring-4")
    assert [step for step, _ in metric(rows, "consensus/distance")] == list(range(10))


@pytest.mark.timeout(300)
def test_monitors_and_their_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for topology in ("ring", "exponential"):
        args = ["--workers", "8", "--topology", topology, "--max-steps", "5", "--root", "logs"]
        run_in_process("examples.recipes.simulate", args, monkeypatch, tmp_path)
    for run in ("ring-8", "exponential-8"):
        distances = [value for _, value in metric(read_metrics(tmp_path / "logs" / run), "consensus/distance")]
        assert len(distances) == 5 and all(0 < d < math.inf for d in distances), distances
    run_in_process(
        "lightning_decentral.plot", ["logs/ring-8", "logs/exponential-8", "--out", "plots"], monkeypatch, tmp_path
    )
    for figure in ("loss", "accuracy", "consensus_distance", "effective_lr_ratio"):
        assert (tmp_path / "plots" / f"{figure}.png").stat().st_size > 0


@pytest.mark.timeout(600)
def test_fabric_trains_and_resumes(tmp_path: Path) -> None:
    out = run_module(tmp_path, "examples.recipes.fabric", "--epochs", "1", "--root", "logs")
    first = re.search(r"epoch 0: step 23, train loss ([0-9.]+), val_acc of x̄ ([0-9.]+)", out)
    assert first and float(first.group(2)) > 0.5, out[-3000:]  # an MLP on the digits: far above chance in an epoch
    assert (tmp_path / "logs" / "last.ckpt").is_file()
    out = run_module(tmp_path, "examples.recipes.fabric", "--epochs", "2", "--root", "logs")
    assert "resumed after epoch 0 (step 23)" in out and "epoch 1: step 46," in out, out[-3000:]


@pytest.mark.timeout(600)
def test_resume_goes_on_from_the_last_checkpoint(tmp_path: Path) -> None:
    out = run_module(tmp_path, "examples.recipes.resume", "--max-steps", "10", "--root", "logs")
    assert "started at step 0, ended at step 10" in out, out[-3000:]
    out = run_module(tmp_path, "examples.recipes.resume", "--max-steps", "20", "--root", "logs")
    assert "started at step 10, ended at step 20" in out, out[-3000:]
    assert (tmp_path / "logs" / "checkpoints" / "epoch=0-step=20.ckpt").is_file()


@pytest.mark.timeout(600)
def test_survivors_go_on_and_the_lost_worker_rejoins_under_the_launcher(tmp_path: Path) -> None:
    command = [
        str(Path(sys.executable).with_name("lightning-decentral-launch")),
        *("--nproc-per-node", "3", "--max-restarts", "1"),
        str(ROOT / "examples" / "recipes" / "rejoin.py"),
        *("--kill", "1:10", "--root", str(tmp_path)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, first_and_last_errors(done.stderr)
    # each worker's line, up to its newline or to the next worker's line (the workers share the launcher's stdout)
    ends = dict(re.findall(r"worker (\d): ended at step 300 among 3; ((?:(?!worker \d:)[^\n])*)", done.stdout))
    assert sorted(ends) == ["0", "1", "2"], done.stdout[-3000:]  # every worker, the one killed too, ended the run
    for survivor in ("0", "2"):  # they lost worker 1 at step 10, went on as two, and admitted it again
        assert re.fullmatch(
            r"Decision at step 10 \(members \[0, 2\]\), Join at step \d+ \(members \[0, 1, 2\]\)", ends[survivor]
        )
    assert re.fullmatch(r"Join at step \d+ \(members \[0, 1, 2\]\)", ends["1"])
    assert "worker 1 started again" in done.stdout and (tmp_path / "killed-1").exists()
