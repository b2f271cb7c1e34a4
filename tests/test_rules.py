"""Every update rule of ``lightning_decentral.rules`` in one process against the dense reference.

No torch.distributed and no Trainer: ``tests.dense_executor`` runs ``n`` workers' rules over one
``DenseMixer`` (its docstring gives the phase order), and each worker's parameters and floating
buffers must equal ``tests.reference.run``'s row to float32 round-off. The residuals the rules
report, the DenseMixer's misuse error and the observers' events are checked here too.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lightning_decentral.mixing import DenseMixer, ExchangeEvent, ExchangeObserver
from lightning_decentral.rules import DecentLaM
from lightning_decentral.schedule import StepPlan
from lightning_decentral.topology import resolve_topology
from tests import reference
from tests.dense_executor import DenseExecutor
from tests.marks import slow_cases
from tests.reference import Config

N = 4
ATOL = 1e-5
BF16 = torch.bfloat16
SGD = {"lr": 0.1}
MOMENTUM = {"lr": 0.05, "momentum": 0.9}
ADAM = {"name": "adam", "lr": 0.01}
NESTEROV_WD = {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
RULES = {"awc": {"combine": "awc"}, "atc": {"combine": "atc"}, "decentlam": {"momentum": "decentlam"}}
TOPOLOGIES = ("ring", "one_peer_exponential", "exponential", "complete")


def _cases() -> list[tuple[Config, int]]:
    cases = []
    for rule, kw in RULES.items():

        def cfg(name: str, rule: str = rule, kw: dict = kw, **extra) -> Config:
            return Config(f"{rule}-{name}", **kw, **extra)

        # In bf16, a value within float32 round-off of a bf16 rounding boundary may round either way here and
        # in the reference (which computes in float64); DecentLaM amplifies that round-off by 1/γ (g̃ = (x − W z)/γ),
        # and on "exponential" one of its values lands on a boundary at step 5 (a 6e-4 difference): these runs avoid it.
        bf16_topology = "ring" if rule == "decentlam" else "exponential"
        cases += [(cfg(f"{topology}-momentum", topology=topology, optimizer=MOMENTUM), N) for topology in TOPOLOGIES]
        cases += [
            (cfg("ring-sgd", optimizer=SGD), N),
            (cfg("one_peer_exponential-sgd", topology="one_peer_exponential", optimizer=SGD), N),
            (cfg("ring-adam", optimizer=ADAM), N),
            (cfg("complete-adam", topology="complete", optimizer=ADAM), N),
            (cfg("ring-every2-rounds2", optimizer=MOMENTUM, gossip_every=2, gossip_steps=2), N),
            (cfg("exponential-every2-rounds2-sgd", topology="exponential", gossip_every=2, gossip_steps=2), N),
            (
                cfg(
                    "one_peer_exponential-rounds2", topology="one_peer_exponential", optimizer=MOMENTUM, gossip_steps=2
                ),
                N,
            ),
            (cfg("ring-accumulate-clip", optimizer=MOMENTUM, accumulate=2, clip=0.05), N),
            (
                cfg(
                    "one_peer_exponential-accumulate", topology="one_peer_exponential", optimizer=MOMENTUM, accumulate=2
                ),
                N,
            ),
            (cfg("ring-batchnorm", optimizer=MOMENTUM, batch_norm=True), N),
            (
                cfg(
                    "one_peer_exponential-batchnorm-clip",
                    topology="one_peer_exponential",
                    optimizer=MOMENTUM,
                    batch_norm=True,
                    clip=0.05,
                ),
                N,
            ),
            (cfg("ring-nesterov-wd-step-scheduler", optimizer=NESTEROV_WD, scheduler="step"), N),
            (cfg("ring-warmup-from-zero", optimizer=MOMENTUM, scheduler="warmup"), N),
            (cfg("ring-bf16", optimizer=MOMENTUM, gossip_dtype=BF16), N),
            (
                cfg(
                    "one_peer_exponential-rounds2-bf16",
                    topology="one_peer_exponential",
                    optimizer=MOMENTUM,
                    gossip_steps=2,
                    gossip_dtype=BF16,
                ),
                N,
            ),
            (
                cfg(
                    f"{bf16_topology}-batchnorm-bf16",
                    topology=bf16_topology,
                    optimizer=MOMENTUM,
                    batch_norm=True,
                    gossip_dtype=BF16,
                ),
                N,
            ),
            (cfg("complete-bf16", topology="complete", optimizer=MOMENTUM, gossip_dtype=BF16), N),
            (cfg("ring-warmup-from-zero-bf16", optimizer=MOMENTUM, scheduler="warmup", gossip_dtype=BF16), N),
            (cfg("ring-rounds-by-step", optimizer=MOMENTUM, gossip_steps={"step": {0: 3, 2: 1, 4: 2}}), N),
            (
                cfg(
                    "exponential-every2-rounds-by-epoch",
                    topology="exponential",
                    optimizer=MOMENTUM,
                    gossip_every=2,
                    gossip_steps={"epoch": {0: 1, 1: 3}},
                    steps_per_epoch=2,
                    steps=8,
                ),
                N,
            ),
            (cfg("exponential-n8", topology="exponential", optimizer=MOMENTUM), 8),
            (
                cfg(
                    "one_peer_exponential-n8-batchnorm",
                    topology="one_peer_exponential",
                    optimizer=MOMENTUM,
                    batch_norm=True,
                ),
                8,
            ),
        ]
    cases += [
        (Config("decentlam-ring-small-buckets", momentum="decentlam", optimizer=MOMENTUM, bucket_cap_mb=1e-4), N),
        (
            Config(
                "decentlam-ring-small-buckets-accumulate-clip",
                momentum="decentlam",
                optimizer=MOMENTUM,
                bucket_cap_mb=1e-4,
                accumulate=2,
                clip=0.05,
            ),
            N,
        ),
        (Config("awc-ring-float64", optimizer=MOMENTUM, dtype=torch.float64), N),
    ]
    return cases


CASES = _cases()


SLOW_CASES = {  # more than ~2 s each (BatchNorm, 8 workers): the fast loop -m "not slow" leaves them out
    "atc-one_peer_exponential-n8-batchnorm",
    "awc-one_peer_exponential-n8-batchnorm",
    "decentlam-one_peer_exponential-n8-batchnorm",
    "atc-one_peer_exponential-batchnorm-clip",
    "awc-one_peer_exponential-batchnorm-clip",
    "atc-exponential-batchnorm-bf16",
}


@pytest.mark.parametrize(("config", "n"), slow_cases(CASES, SLOW_CASES), ids=[f"{c.name}" for c, _ in CASES])
def test_every_worker_matches_the_dense_reference(config: Config, n: int) -> None:
    executor = DenseExecutor(config, n)
    trained = executor.run()
    expected = reference.run(config, n)
    assert trained.shape == expected.shape
    for i in range(n):
        torch.testing.assert_close(trained[i].double(), expected[i].double(), atol=ATOL, rtol=0, msg=f"worker {i}")
    if config.topology != "complete":  # decentralized: the workers really differ
        assert (expected[0] - expected[1]).abs().max() > 1e-4
    decentlam_not_sgd = config.momentum == "decentlam" and config.optimizer.get("name", "sgd") != "sgd"
    assert len(executor.warnings) == n * int(decentlam_not_sgd)  # each worker warns once


# -- residuals ---------------------------------------------------------------------------------


def _dense_residuals(y: torch.Tensor, config: Config, n: int, step: int) -> torch.Tensor:
    """``‖y_i − Σ_j w_ij y_j‖²`` per worker, one round of the dense ``W(step)``."""
    y = y.double()
    return (y - reference.mixing(config.topology, n, step) @ y).square().sum(dim=1)


@pytest.mark.parametrize(
    "config",
    [
        Config("awc-ring-rounds2-batchnorm", optimizer=MOMENTUM, gossip_steps=2, batch_norm=True, steps=3),
        Config("awc-one_peer-every2", topology="one_peer_exponential", gossip_every=3, steps=4),
        Config("atc-exponential", topology="exponential", combine="atc", optimizer=MOMENTUM, steps=3),
        Config(
            "decentlam-ring-clip-small-buckets",
            momentum="decentlam",
            optimizer=MOMENTUM,
            clip=0.05,
            bucket_cap_mb=1e-4,
            steps=3,
        ),
        Config(
            "decentlam-one_peer-batchnorm",
            topology="one_peer_exponential",
            momentum="decentlam",
            optimizer=MOMENTUM,
            batch_norm=True,
            steps=3,
        ),
    ],
    ids=lambda c: c.name,
)
def test_the_residual_is_that_of_the_dense_mixing(config: Config) -> None:
    """AWC: of ``y = x(k)``; ATC: of ``y = U(x(k), g)``; DecentLaM: of ``z = x(k) − γ g`` (the first
    round; over the trainable parameters only, not the mixed module buffers)."""
    executor = DenseExecutor(config, N, measure_residuals=True)
    exchanged: dict[int, torch.Tensor] = {}

    def before(k: int) -> None:
        if config.combine == "awc" and config.momentum != "decentlam":
            exchanged[k] = executor.parameters()

    def after_closures(k: int) -> None:
        if config.momentum == "decentlam":
            lr = executor.optimizers[0].param_groups[0]["lr"]
            grads = torch.stack([torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in executor.modules])
            exchanged[k] = executor.parameters() - lr * grads

    def after_update(k: int) -> None:
        if config.combine == "atc" and config.momentum != "decentlam":
            exchanged[k] = executor.parameters()

    gossiped = 0
    for k in range(config.steps):
        before(k)
        executor.step(k, after_closures=after_closures, after_update=after_update)
        measured = [rule.residual(k) for rule in executor.rules]
        if not executor.schedule.plan(k).gossips:
            assert measured == [None] * N, f"step {k} is local"
            continue
        gossiped += 1
        expected = _dense_residuals(exchanged[k], config, N, k)
        assert all(r is not None for r in measured)
        assert float(expected.min()) > 0
        torch.testing.assert_close(torch.stack(measured), expected, rtol=1e-5, atol=1e-12, msg=f"step {k}")
        assert all(rule.residual(k + 1) is None for rule in executor.rules)  # only the step asked for
    assert gossiped >= 1


def test_no_residual_unless_measured() -> None:
    executor = DenseExecutor(Config("awc", steps=2), N)
    executor.run()
    assert [rule.residual(1) for rule in executor.rules] == [None] * N


# -- the DenseMixer's constraint -------------------------------------------------------------------


def test_a_worker_waiting_before_every_worker_started_is_a_clear_error() -> None:
    mixer = DenseMixer(resolve_topology("ring", N))
    x = [torch.full((3,), float(i)) for i in range(N)]
    pending = [mixer.worker(i).start([x[i]], step=0) for i in range(2)]
    with pytest.raises(RuntimeError, match=r"Workers \[2, 3\] have not started exchange \(step 0, tag 0\) yet"):
        pending[0].wait()
    assert [float(v[0]) for v in x] == [0.0, 1.0, 2.0, 3.0]  # nothing was mixed

    pending = mixer.worker(0).start([x[0]], step=1)
    with pytest.raises(RuntimeError, match=r"Worker 0 started exchange \(step 1, tag 0\) twice"):
        mixer.worker(0).start([x[0]], step=1)
    with pytest.raises(ValueError, match="rank must be in"):
        mixer.worker(N)


def test_running_one_worker_s_whole_step_before_the_next_fails_with_that_error() -> None:
    """The reason the executor runs phase by phase: worker 0's AWC closure waits for ``x(0)``."""
    executor = DenseExecutor(Config("awc-sequential", optimizer=MOMENTUM), N)
    rule = executor.rules[0]
    rule.begin_step(StepPlan(0, 1))
    with pytest.raises(RuntimeError, match=r"Workers \[1, 2, 3\] have not started exchange \(step 0, tag 0\)"):
        rule.wrap_closure(lambda: None)()


def test_decentlam_optimizer_step_of_one_worker_before_the_others_posted_fails() -> None:
    executor = DenseExecutor(Config("decentlam-sequential", momentum="decentlam", optimizer=MOMENTUM), N)
    closure = executor.forward_backward(0, 0)
    rule = executor.rules[0]
    rule.begin_step(StepPlan(0, 1))
    with pytest.raises(RuntimeError, match=r"Workers \[1, 2, 3\] have not started exchange \(step 0"):
        executor.optimizers[0].step(rule.wrap_closure(closure))


# -- observers ------------------------------------------------------------------------------------


class Recorder(ExchangeObserver):
    def __init__(self) -> None:
        self.posts: list[ExchangeEvent] = []
        self.waits: list[ExchangeEvent] = []

    def on_post(self, event: ExchangeEvent) -> None:
        assert event.wait_started is None and event.waited is None
        self.posts.append(event)

    def on_wait(self, event: ExchangeEvent) -> None:
        self.waits.append(event)


def _nbytes(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> int:
    return sum(t.numel() * (dtype or t.dtype).itemsize for t in tensors)


@pytest.mark.parametrize(
    "config",
    [
        Config(
            "awc-ring-every2-rounds2-batchnorm",
            optimizer=MOMENTUM,
            gossip_every=2,
            gossip_steps=2,
            batch_norm=True,
            steps=4,
        ),
        Config("awc-complete-batchnorm", topology="complete", optimizer=MOMENTUM, batch_norm=True, steps=2),
        Config("atc-ring-bf16", combine="atc", gossip_dtype=BF16, steps=3),
        Config(
            "decentlam-ring-small-buckets-batchnorm",
            momentum="decentlam",
            optimizer=MOMENTUM,
            bucket_cap_mb=1e-4,
            batch_norm=True,
            gossip_steps=2,
            steps=3,
        ),
        Config(
            "decentlam-exponential-clip",
            topology="exponential",
            momentum="decentlam",
            optimizer=MOMENTUM,
            clip=0.05,
            steps=2,
        ),
    ],
    ids=lambda c: c.name,
)
def test_observers_see_every_exchange_once(config: Config) -> None:
    shared = Recorder()
    executor = DenseExecutor(config, N, observers=[shared])
    recorders = [Recorder() for _ in range(N)]
    for rule, recorder in zip(executor.rules, recorders):
        rule.mixer.observers.append(recorder)
    executor.run()

    replica = executor.replicas[0]
    average = config.topology == "complete"
    neighbours = 2  # ring and exponential of 4: two others in every column of W
    if isinstance(executor.rules[0], DecentLaM):
        buckets = executor.rules[0].buckets.num_buckets
        assert buckets > 1 or config.bucket_cap_mb >= 1
        # each bucket's z (the parameters' dtype and layout), then the buffers
        per_tag = {tag: None for tag in range(buckets)}
        if replica.flat_buffers:
            per_tag[buckets] = _nbytes(replica.flat_buffers, config.gossip_dtype)
        total_z = _nbytes(replica.flat_parameters, config.gossip_dtype)
    else:
        per_tag = {0: _nbytes(replica.mixed, config.gossip_dtype)}  # AWC: x(k), the buffers' snapshot; ATC: U(x)
        total_z = None
    gossip_steps = [k for k in range(config.steps) if executor.schedule.plan(k).gossips]
    assert gossip_steps

    for recorder in recorders:
        # one post and one wait per (step, tag), for the very same event, in order
        assert Counter((e.step, e.tag) for e in recorder.posts) == Counter(
            {(k, tag): 1 for k in gossip_steps for tag in per_tag}
        )
        assert [id(e) for e in recorder.waits] == [id(e) for e in recorder.posts]
        for event in recorder.posts:
            assert event.rounds == config.gossip_steps
            assert event.post_started <= event.posted <= event.wait_started <= event.waited
        z_bytes = 0
        for event in recorder.posts:
            size = per_tag[event.tag]
            if size is None:  # a bucket of z: summed over the buckets below
                z_bytes += event.bytes_sent
                continue
            per_round = size * 2 * (N - 1) // N if average else neighbours * size
            assert event.bytes_sent == config.gossip_steps * per_round, event
        if total_z is not None:
            assert z_bytes == len(gossip_steps) * config.gossip_steps * neighbours * total_z
    # the mixer's own observers see every worker's events, the same objects
    assert sorted(id(e) for r in recorders for e in r.posts) == sorted(id(e) for e in shared.posts)
    assert sorted(id(e) for r in recorders for e in r.waits) == sorted(id(e) for e in shared.waits)


def test_a_second_wait_reports_nothing_more() -> None:
    mixer = DenseMixer(resolve_topology("ring", N), dtype=BF16)
    recorder = Recorder()
    mixer.observers.append(recorder)
    x = [torch.full((10,), float(i)) for i in range(N)]
    pending = [mixer.worker(i).start([x[i]], step=0, rounds=3, tag=5) for i in range(N)]
    assert len(recorder.posts) == N and not recorder.waits
    for p in pending:
        p.wait()
    for p in pending:
        p.wait()
    assert [e.tag for e in recorder.waits] == [5] * N and [e.step for e in recorder.waits] == [0] * N
    assert all(e.bytes_sent == 3 * 2 * 10 * 2 for e in recorder.waits)  # 3 rounds, 2 neighbours, 10 bf16 values
    assert [id(e) for e in recorder.waits] == [id(e) for e in recorder.posts]


@pytest.mark.parametrize("rule", ["awc", "decentlam"])
def test_a_step_that_never_reached_the_optimizer_is_drained(rule: str) -> None:
    """Step 0's exchange is in flight (AWC: x(0), posted by begin_step; DecentLaM: z, posted during backward)
    and the optimizer never steps: AWC's next begin_step finishes it, DecentLaM's drain() does; nothing moves."""
    executor = DenseExecutor(Config(f"{rule}-skip", optimizer=MOMENTUM, **RULES[rule]), N)
    start = executor.state()
    for r in executor.rules:
        r.begin_step(executor.schedule.plan(0))
    if rule == "decentlam":  # z is posted during backward
        for i, r in enumerate(executor.rules):
            r.wrap_closure(executor.forward_backward(i, 0))()
        for r in executor.rules:
            r.drain()
    assert torch.equal(executor.state(), start)
    executor.step(1)  # AWC: begin_step(1) drains x(0)'s exchange first
    assert executor.mixer.in_flight == 0  # every exchange was completed
    assert torch.isfinite(executor.state()).all() and not torch.equal(executor.state(), start)


# -- local steps with an outer optimizer -----------------------------------------------------------

NESTEROV_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
OUTER_CASES = [
    Config(
        "outer-complete-nesterov",
        topology="complete",
        optimizer=MOMENTUM,
        outer=NESTEROV_OUTER,
        gossip_every=3,
        steps=9,
    ),
    Config("outer-complete-adam", topology="complete", optimizer=ADAM, outer=NESTEROV_OUTER, gossip_every=2),
    Config(
        "outer-complete-batchnorm",
        topology="complete",
        optimizer=MOMENTUM,
        outer=NESTEROV_OUTER,
        gossip_every=2,
        batch_norm=True,
    ),
    Config("outer-ring-nesterov", optimizer=MOMENTUM, outer=NESTEROV_OUTER, gossip_every=2, steps=8),
    Config(
        "outer-one_peer-heavy-ball-batchnorm",
        topology="one_peer_exponential",
        optimizer=MOMENTUM,
        outer={"lr": 0.5, "momentum": 0.8},
        gossip_every=3,
        steps=9,
        batch_norm=True,
    ),
    Config(
        "outer-ring-overlap",
        optimizer=MOMENTUM,
        outer=NESTEROV_OUTER,
        outer_overlap=True,
        gossip_every=2,
        steps=9,
        batch_norm=True,
    ),
    Config(
        "outer-complete-overlap",
        topology="complete",
        optimizer=MOMENTUM,
        outer=NESTEROV_OUTER,
        outer_overlap=True,
        gossip_every=3,
        steps=10,
    ),
    Config("outer-ring-bf16", optimizer=MOMENTUM, outer=NESTEROV_OUTER, gossip_every=2, steps=8, gossip_dtype=BF16),
    Config(
        "outer-exponential-rounds2-overlap-bf16",
        topology="exponential",
        optimizer=MOMENTUM,
        outer=NESTEROV_OUTER,
        outer_overlap=True,
        gossip_every=2,
        gossip_steps=2,
        steps=9,
        gossip_dtype=BF16,
        batch_norm=True,
    ),
]


SLOW_OUTER = {"outer-complete-batchnorm", "outer-one_peer-heavy-ball-batchnorm", "outer-ring-overlap"}
SLOW_OUTER |= {"outer-exponential-rounds2-overlap-bf16"}  # BatchNorm, more than ~2 s each


@pytest.mark.parametrize("config", slow_cases(OUTER_CASES, SLOW_OUTER), ids=[c.name for c in OUTER_CASES])
def test_outer_steps_match_the_reference_written_from_the_papers(config: Config) -> None:
    """Every worker's `OuterStep` over a DenseMixer is the decentralized form of docs/algorithms.md; on the complete
    graph (without overlap) it is also DiLoCo's Algorithm 1: one anchor, the mean pseudo-gradient, every worker
    restarting from the anchor."""
    from tests import outer_reference

    trained = DenseExecutor(config, N).run().double()
    expected = outer_reference.decentralized(config, N)
    torch.testing.assert_close(trained, expected, atol=ATOL, rtol=0)
    if config.topology == "complete" and not config.outer_overlap:
        torch.testing.assert_close(trained, outer_reference.diloco(config, N), atol=ATOL, rtol=0)
        assert (trained - trained[0]).abs().max() == 0  # one anchor: the workers are equal after a round
    else:
        assert (expected[0] - expected[1]).abs().max() > 1e-4
    # not periodic averaging: the outer optimizer moved the anchor elsewhere
    averaging = reference.run(
        Config(
            config.name,
            topology=config.topology,
            combine="atc",
            optimizer=config.optimizer,
            gossip_every=config.gossip_every,
            steps=config.steps,
            batch_norm=config.batch_norm,
        ),
        N,
    )
    assert (trained - averaging).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["complete", "ring"])
def test_an_outer_sgd_step_of_lr_1_is_periodic_averaging(topology: str) -> None:
    """`θ_i <- θ_i − 1 · (θ_i − Σ_j w_ij x_j)` is ATC's `x <- W x` every H steps (DiLoCo's outer lr 1, no momentum)."""
    plain = Config(
        "atc-every-3", topology=topology, combine="atc", optimizer=MOMENTUM, gossip_every=3, steps=9, batch_norm=True
    )
    outer = Config(
        "outer-lr-1", topology=topology, optimizer=MOMENTUM, gossip_every=3, steps=9, batch_norm=True, outer={"lr": 1.0}
    )
    torch.testing.assert_close(DenseExecutor(outer, N).run(), DenseExecutor(plain, N).run(), atol=2e-7, rtol=0)
