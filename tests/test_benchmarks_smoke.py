"""Each benchmark runs end to end for a couple of steps (no timing is asserted here)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import benchmarks_harness

pytestmark = pytest.mark.slow  # every test here runs a benchmark script in processes of its own

ROOT = Path(__file__).resolve().parents[1]


def test_step_time_smoke(tmp_path: Path) -> None:
    """A row per method asked for, on every rank, with positive finite step times in order (25 % <= median <= 75 %)
    for each measured step, and byte counts that follow from the model's size: ddp's ring all-reduce model
    `2(n - 1)/n` x the float32 model, the ring's exchange 2 out-neighbours x the float32 model, as the strategy
    counted it."""
    out = tmp_path / "results.json"
    _run_smoke("step_time.py", "--methods", "ddp,ring", "--out", str(out))
    results = json.loads(out.read_text())
    meta, rows = results["meta"], results["rows"]
    parameters, n, steps = meta["parameters"], meta["workers"], meta["config"]["steps"]
    assert parameters == benchmarks_harness().count_parameters(tuple(meta["widths"])) > 0
    assert [(row["name"], row["ranks"], row["parameters"]) for row in rows] == [
        ("ddp", n, parameters),
        ("ring", n, parameters),
    ]
    for row in rows:
        times = [row["median_s"], row["q25_s"], row["q75_s"], row["mean_s"], *row["repeat_medians_s"]]
        assert len(row["repeat_medians_s"]) == meta["repeats"] and all(0 < t < math.inf for t in times), row
        assert row["q25_s"] <= row["median_s"] <= row["q75_s"], row
        assert [len(repeat) for repeat in row["step_times_slowest_rank_s"]] == [steps] * meta["repeats"], row
        assert all(0 < t < math.inf for repeat in row["step_times_slowest_rank_s"] for t in repeat), row
    model_bytes = 4 * parameters
    ddp, ring = rows
    assert ddp["bytes_sent_per_rank"] == 2 * (n - 1) / n * model_bytes, ddp
    assert ring["bytes_sent_per_rank"] == ring["gossip_bytes_sent_reported"] == 2 * model_bytes, ring


@pytest.mark.slow
def test_compressor_arithmetic_smoke(tmp_path: Path) -> None:
    """Every default compressor's step of arithmetic and the copy baseline are timed, once per buffer size, with a
    ratio to the copy (the copy's own is 1)."""
    out = tmp_path / "arithmetic.json"
    _run_smoke("compressor_arithmetic.py", "--numel", "4099,70001", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    names = ["copy", "sign", "int8", "int4", "top_k:0.01", "random_k:0.01"]
    assert [(row["numel"], row["compressor"]) for row in rows] == [(n, c) for n in (4099, 70001) for c in names]
    assert all(row["median_s"] >= 0 and row["ratio_to_copy"] >= 0 for row in rows)
    assert all(row["ratio_to_copy"] == 1 for row in rows if row["compressor"] == "copy" and row["median_s"] > 0)


def test_gpu_smoke(tmp_path: Path) -> None:
    """The GPU script's runs on the CPU: both rules train, save and resume; both simulation paths are timed, on the MLP
    and on the conv + BatchNorm ResNet-20 (small)."""
    out = tmp_path / "gpu.json"
    _run_smoke("gpu.py", "--out", str(out))
    result = json.loads(out.read_text())
    assert [(r["momentum"], r["ok"], r["ended_at"]) for r in result["paths"]] == [
        ("local", True, 5),
        ("decentlam", True, 5),
    ]
    runs = [("lightning", 1), ("apart", 4), ("stacked", 4)]
    assert [(r["model"], r["kind"], r["n"]) for r in result["simulation"]] == [
        (m, *run) for m in ("mlp", "resnet20") for run in runs
    ]
    assert all(r["step_s"] > 0 and "error" not in r for r in result["simulation"])


def test_simulate_smoke(tmp_path: Path) -> None:
    out = tmp_path / "simulate.json"
    _run_smoke("simulate.py", "--out", str(out))
    result = json.loads(out.read_text())
    assert [(row["name"], row["n"]) for row in result["rows"]] == [
        ("sim", 4),
        ("vectorized", 4),
        ("bare", 4),
        ("processes", 4),
        ("lightning", 1),
    ]
    assert all(row["median_s"] > 0 and row["first_step_s"] > 0 and row["maxrss_mb"] > 0 for row in result["rows"])
    differences = result["meta"]["bare_vs_sim_max_abs_diff"]
    assert (
        differences["sim 4"] < 1e-4 and differences["vectorized 4"] < 1e-4
    )  # the bare loop makes both simulations' update


def test_stragglers_smoke(tmp_path: Path) -> None:
    out = tmp_path / "stragglers.json"
    _run_smoke("stragglers.py", "--out", str(out))
    result = json.loads(out.read_text())
    assert [row["method"] for row in result["throughput"]] == ["ddp", "ring_awc_s1"]
    (launch,) = result["throughput"][1]["launches"]
    assert launch["steps_per_s"] > 0 and sum(launch["when_first_finished"]) > 0
    assert [(row["rule"], row["staleness"]) for row in result["accuracy"]] == [("awc", 0), ("awc", 1)]


def test_restart_smoke(tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    _run_smoke("restart.py", "--profile", "--out", str(out))
    rows = json.loads(out.read_text())["cost"]
    assert [row["method"] for row in rows] == ["none", "every2_background", "ddp_none", "ddp_every2_background"]
    assert rows[0]["ratio_to_none"] == 1.0 and all(row["mean_step_s"] > 0 for row in rows)
    assert rows[2]["ratio_to_none"] == 1.0  # a ddp_ method's ratio is against ddp_none
    assert all(row["cpu_per_step_s"] > 0 for row in rows)
    first, last = rows[1]["profile"]  # rank 0's and the last rank's functions in the save hook
    assert any(name.endswith(":save_checkpoint") for name, _, _ in first) and last


def test_survive_accuracy_smoke(tmp_path: Path) -> None:
    out = tmp_path / "survive.json"
    _run_smoke("survive.py", "accuracy", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["at_step"] == 1 and list(result["accuracy"]) == ["none lost", "1 lost", "4 lost", "8 lost"]
    assert all(len(values) == 1 and 0 <= values[0] <= 1 for values in result["accuracy"].values())


def test_chaos_smoke(tmp_path: Path) -> None:
    """The chaos soak's short form: 3 workers under `lightning-decentral-launch --max-restarts 1`, one `SIGKILL` at
    step 45 of 90; the launcher reports the kill and starts the worker again, which rejoins (the last decision of every
    worker admits it, the members all three), no worker fails otherwise, all 3 end at step 90 as 3 ranks with finite
    replicas and a finite accuracy of x̄ (their mean), and the checkpoint of step 90 resumes on 3 processes bit for
    bit. (Also the end-to-end test of rejoining under the launcher.)"""
    out = tmp_path / "chaos.json"
    _run_smoke("chaos.py", "--modes", "rejoin", "--max-restarts", "1", "--directory", str(tmp_path), "--out", str(out))
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["exit"], len(run["kills"]), run["unplanned_starts"]) == (0, 1, 0), run
    assert run["ended_at"] == {str(rank): 90 for rank in range(3)}, run["ended_at"]
    assert 0.0 <= run["accuracy"] <= 1.0 and run["resumes_exactly"] is True, run
    ((victim, pid),) = [(kill["rank"], kill["pid"]) for kill in run["kills"]]
    launched = run["launcher"]
    assert f"lightning-decentral-launch: worker {victim} (pid {pid}) was killed by SIGKILL" in launched, launched
    again = f"lightning-decentral-launch: worker {victim} started again (pid "
    assert any(line.startswith(again) and line.endswith("restart 1 of 1)") for line in launched), launched
    for result in run["results"].values():
        assert result["world_size"] == 3 and result["finite"], result
        assert result["decisions"][-1]["joined"] == [victim] and result["decisions"][-1]["members"] == [0, 1, 2], result


def test_compression_smoke(tmp_path: Path) -> None:
    """Bytes counted and read on the loopback per compressor, and the consensus-vs-γ sweep, for a few steps."""
    out = tmp_path / "bytes.json"
    _run_smoke("compression.py", "bytes", "--compressions", "sign,top_k:0.01", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["compression"] for row in rows] == ["None", "sign", "top_k:0.01"]
    assert all(row["measured_per_rank_step"] >= row["counted_per_rank_step"] > 0 for row in rows)
    out = tmp_path / "sweep.json"
    _run_smoke("compression.py", "sweep", "--compressions", "int8", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(row["topology"], row["compression"]) for row in rows] == [
        ("ring", "int8"),
        ("one_peer_exponential", "int8"),
    ]
    assert all(0 < ratio < 1 for row in rows for ratio in row["ratio"].values())


def test_compression_accuracy_smoke(tmp_path: Path) -> None:
    """The digits runs of `accuracy` and `gamma` (4 workers, 1 epoch, 1 seed)."""
    out = tmp_path / "accuracy.json"
    _run_smoke("compression.py", "accuracy", "--compressions", "sign", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["label"] for row in rows] == ["all-reduce (complete, ATC)", "gossip", "sign"]
    assert all(len(row["accuracy"]) == 1 and 0 <= row["accuracy"][0] <= 1 for row in rows)
    assert rows[0]["distance"] == [0.0] and rows[2]["distance"][0] > 0  # the complete graph averages exactly
    out = tmp_path / "gamma.json"
    _run_smoke("compression.py", "gamma", "--compressions", "int8", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["options"].get("consensus_step") for row in rows] == [None, 0.05, 0.1]


def test_outer_overlap_smoke(tmp_path: Path) -> None:
    """Both modes run on 2 processes in one launch; the blocked time and step time of each are measured."""
    out = tmp_path / "outer_overlap.json"
    _run_smoke("outer_overlap.py", "--out", str(out))
    result = json.loads(out.read_text())
    for mode in ("no_overlap", "overlap"):
        assert len(result[mode]["step_s"]["runs"]) == 1 and result[mode]["step_s"]["median"] > 0
        assert result[mode]["blocked_per_round_s"]["median"] >= 0
    assert result["ratio"]["step_s"] > 0 and result["meta"]["profile"] == "loopback"


def _run_smoke(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _emulated_profile(tmp_path: Path, script: str, *arguments: str) -> dict:
    """The one profile a smoke of `script` on the emulated network writes (skipped where namespaces are not
    permitted)."""
    permitted, why = benchmarks_harness().netns_permitted()
    if not permitted:
        pytest.skip(f"the emulated network needs network namespaces: {why}")
    out = tmp_path / f"{Path(script).stem}.json"
    _run_smoke(script, *arguments, "--out", str(out))
    (profile,) = json.loads(out.read_text())["profiles"]
    return profile


def test_netns_smoke(tmp_path: Path) -> None:
    profile = _emulated_profile(tmp_path, "netns.py")
    assert [row["name"] for row in profile["rows"]] == ["ddp", "ring"]
    assert all(row["step_median_s"] > 0 and len(row["loss_s"]) == 1 for row in profile["rows"])
    assert all(len(job["mean_loss"]) == 3 for job in profile["jobs"] if job["kind"] == "loss")
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(profile["namespaces"]) & set(left), left  # torn down


def test_netns_powersgd_smoke(tmp_path: Path) -> None:
    """DDP with PowerSGD's comm hook beside DDP on the emulated network, and what each host's eth0 sent."""
    profile = _emulated_profile(
        tmp_path, "netns.py", "--methods", "ddp,ddp_powersgd", "--jobs", "steps", "--warmup", "2"
    )
    assert [row["name"] for row in profile["rows"]] == ["ddp", "ddp_powersgd"]
    assert all(row["sent_per_step"] > 0 and row["step_median_s"] > 0 for row in profile["rows"])


def test_outer_network_smoke(tmp_path: Path) -> None:
    """The headline's jobs on the emulated network (2 hosts, H = 2): every method trains (the compressed ones too: the
    strategy refuses none), an outer step every 2 steps sends half of what its topology sends every step, `sign`
    less, and each host's eth0 sent at least what the strategy counted."""
    profile = _emulated_profile(tmp_path, "outer_network.py")
    rows = {row["method"]: row for row in profile["rows"]}
    every = {
        "ddp",
        "dpsgd_one_peer",
        "diloco",
        "outer_one_peer",
        "outer_one_peer_sign",
        "diloco_sign",
        "dpsgd_ring",
        "outer_ring",
        "outer_ring_sign",
    }
    assert set(rows) | set(profile["skipped"]) == every
    assert every <= set(rows)  # compression composes with the outer optimizer: nothing refused
    assert rows["outer_one_peer_sign"]["bytes_vs_every_step"] < rows["outer_one_peer"]["bytes_vs_every_step"]
    steps = {name: [point["step"] for point in curve] for name, curve in profile["curves"].items()}
    assert steps.pop("ddp") == [2, 4] and all(s == [2, 4, 6, 8] for s in steps.values())  # the others: --extend 2
    assert rows["diloco"]["bytes_vs_every_step"] == pytest.approx(1 / 2)
    assert rows["outer_one_peer"]["bytes_vs_every_step"] == pytest.approx(1 / 2)
    assert all(row["eth0_sent_per_step"] >= row["counted_per_step"] > 0 for row in rows.values())
    assert rows["outer_one_peer"]["loss"] == pytest.approx(rows["diloco"]["loss"], abs=1e-4)  # one peer of 2: complete
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(profile["namespaces"]) & set(left), left  # torn down


def test_timeline_smoke(tmp_path: Path) -> None:
    out, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    _run_smoke("timeline.py", "--network", "loopback", "--png", str(png), "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result["medians_s"]) == {
        "compute_awc",
        "awc",
        "compute_decentlam",
        "decentlam",
        "atc",
        "comm_awc",
        "comm_decentlam",
    }
    events = result["records"][0]["awc"][0]["events"]
    assert {what for what, *_ in events} == {"post", "wait"}  # the exchange was seen posted and waited for
    assert png.stat().st_size > 0


def test_cost_model_smoke(tmp_path: Path) -> None:
    out, png = tmp_path / "cost.json", tmp_path / "cost.png"
    _run_smoke("cost_model.py", "--png", str(png), "--out", str(out))
    result = json.loads(out.read_text())
    (measured,) = result["measured"]
    alpha, beta = measured["link"]["alpha_s"], measured["link"]["beta_s_per_byte"]
    assert alpha >= 0 and beta >= 0 and alpha + beta > 0
    assert set(measured["exchange_s"]) == {"ddp", "ring", "one_peer_exponential"}
    assert png.stat().st_size > 0


def test_transport_smoke(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    _run_smoke("transport.py", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["bytes"] for row in rows] == [4096, 65536]
    for row in rows:  # every transport was timed (after its result was checked against p2p's)
        assert set(row["median_s"]) == {"p2p", "edge_allreduce", "edge_broadcast", "allgather", "allreduce"}
        assert all(t > 0 for t in row["median_s"].values())


def test_outer_smoke(tmp_path: Path) -> None:
    """Every method of the outer-step benchmark trains and validates; the bytes follow the schedule: an outer step
    every H = 3 steps sends a third of what the same topology sends at every step."""
    out = tmp_path / "outer.json"
    _run_smoke("outer.py", "--out", str(out))
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == [
        "complete_every_step",
        "dpsgd_one_peer",
        "diloco",
        "outer_one_peer",
        "outer_one_peer_overlap",
        "averaging_one_peer",
        "diloco_sign",
        "outer_one_peer_sign",
    ]
    assert all(row["val_loss"] > 0 for row in rows.values())
    sent = {name: row["bytes_per_step"] for name, row in rows.items()}
    assert sent["diloco"] == pytest.approx(sent["complete_every_step"] / 3)
    assert sent["outer_one_peer"] == sent["outer_one_peer_overlap"] == pytest.approx(sent["dpsgd_one_peer"] / 3)
    assert 0 < sent["outer_one_peer_sign"] < sent["dpsgd_one_peer"] / (25 * 3)  # sign: 1 bit and a scale per 1024


@pytest.mark.slow
def test_sharded_smoke(tmp_path: Path) -> None:
    """Issue 37's jobs on the emulated network (4 hosts of 2 ranks): HSDP, the floor and the three sharded methods
    train, every rank holds half of the parameters and optimizer state, and each logs the loss every H = 3 steps."""
    profile = _emulated_profile(tmp_path, "sharded.py")
    rows = {row["method"]: row for row in profile["rows"]}
    assert set(rows) == {"hsdp", "sharded_no_exchange", "sharded_one_peer", "sharded_ring_sign", "sharded_diloco"}
    assert all(row["held_vs_unsharded"] == pytest.approx(0.5) for row in rows.values())
    assert all([p["step"] for p in row["points"]] == [3, 6] and row["step_seconds"] > 0 for row in rows.values())
