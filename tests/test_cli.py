"""The ``lightning-decentral`` command: YAML types, clear errors before training, user modules."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_decentral.cli import main
from lightning_decentral.topology import TOPOLOGIES

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "examples" / "configs" / "digits_dpsgd.yaml")


@pytest.fixture
def run_cli(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> Callable[[list[str]], tuple[int, str, str]]:
    """``lightning-decentral ARGS`` in this process, for what ends before training: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["lightning-decentral"])

    def run(args: list[str]) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        out, err = capsys.readouterr()
        return exit_info.value.code, out, err

    return run


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--trainer.strategy.init_args.topology", "rign"], ["rign", *TOPOLOGIES]),
        (["--trainer.strategy.init_args.gossip_every", "two"], ["gossip_every", "two"]),
        (["--trainer.strategy.init_args.combine", "both"], ["combine", "awc", "atc"]),
        (["--trainer.strategy.init_args.gossip_every", "0"], ["`gossip_every` must be a positive integer"]),
        (["--trainer.strategy.init_args.topology", "torus", "--trainer.devices", "3"], ["A torus needs", "ring"]),
        (["--trainer.max_epochs", "many"], ["max_epochs"]),
    ],
    ids=["unknown-topology", "wrong-type", "bad-choice", "bad-value", "topology-misfit", "trainer-type"],
)
def test_bad_configuration_exits_with_a_message_before_training(args: list[str], expected: list[str], run_cli) -> None:
    code, out, err = run_cli(["fit", "--config", QUICKSTART, *args])
    assert code == 2
    assert "error:" in err and "Traceback" not in err + out
    for text in expected:
        assert text in err, text


def test_topology_by_class_path_and_strategy_by_name(run_cli) -> None:
    code, out, _ = run_cli(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.strategy.init_args.topology",
            "lightning_decentral.Torus",
            "--trainer.strategy.init_args.topology.rows",
            "2",
            "--print_config",
        ]
    )
    assert code == 0
    assert "class_path: lightning_decentral.Torus" in out and "rows: 2" in out
    code, out, _ = run_cli(["fit", "--config", QUICKSTART, "--trainer.strategy", "decentlam", "--print_config"])
    assert code == 0 and "strategy: decentlam" in out


USER_MODULE = """
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, TensorDataset


class TinyRegression(LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class TinyData(LightningDataModule):
    def __init__(self, samples: int = 32) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(samples, 3, generator=generator)
        self.data = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=8)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_user_module_on_pythonpath_trains(tmp_path: Path) -> None:
    """The console command, a model and data from the user's own module on PYTHONPATH, run elsewhere."""
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "my_project.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tiny.yaml").write_text(
        textwrap.dedent("""
        trainer:
          accelerator: cpu
          devices: 1
          strategy: dpsgd
          max_steps: 3
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
        model:
          class_path: my_project.TinyRegression
          init_args: {lr: 0.05}
        data: my_project.TinyData
    """)
    )
    command = Path(sys.executable).with_name("lightning-decentral")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "user")}
    done = subprocess.run(
        [str(command), "fit", "--config", "tiny.yaml"],
        cwd=tmp_path / "run",
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Finished fit after 3 steps on 1 workers (dpsgd awc, Ring(world_size=1))." in done.stdout
    assert "Validation of the averaged model x̄: val_mse = " in done.stdout


@pytest.mark.parametrize(
    "strategy", ["lightning_decentral.DecentralizedStrategy", "lightning_decentral.SimulatedDecentralizedStrategy"]
)
@pytest.mark.parametrize(
    "name, printed",
    [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("torch.bfloat16", "torch.bfloat16")],
)
def test_gossip_dtype_by_name(strategy: str, name: str, printed: str, run_cli) -> None:
    """YAML and the command line name the message precision as the Python API does: `bfloat16`, `torch.bfloat16`."""
    code, out, err = run_cli(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.strategy",
            strategy,
            "--trainer.strategy.init_args.gossip_dtype",
            name,
            "--print_config",
        ]
    )
    assert code == 0, err
    assert f"gossip_dtype: {printed}" in out


def test_unknown_gossip_dtype_names_the_choices(run_cli) -> None:
    code, out, err = run_cli(["fit", "--config", QUICKSTART, "--trainer.strategy.init_args.gossip_dtype", "bf16"])
    assert code == 2
    assert "error:" in err and "Traceback" not in err + out
    for text in ["gossip_dtype", "bf16", "bfloat16", "float16", "float32"]:
        assert text in err, text


def test_gossip_dtype_by_name_reaches_the_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from lightning_decentral.cli import DecentralizedCLI

    monkeypatch.setattr(sys, "argv", ["lightning-decentral"])
    cli = DecentralizedCLI(
        args=[
            "--config",
            QUICKSTART,
            "--trainer.strategy.init_args.gossip_dtype",
            "bfloat16",
            "--trainer.logger",
            "false",
        ],
        run=False,
    )
    assert cli.trainer.strategy.gossip_dtype is torch.bfloat16


@pytest.mark.parametrize("args", [["--help"], ["fit", "--help"]], ids=["command", "fit"])
def test_help_describes_the_command_and_how_to_see_the_strategy_options(args: list[str], run_cli) -> None:
    code, out, _ = run_cli(args)
    text = " ".join(out.split())  # the help is wrapped to the terminal
    assert code == 0
    assert "Lightning Trainer command line tool" not in text
    if args == ["--help"]:
        assert "decentralized (gossip) strategies registered" in text
    assert "lightning-decentral fit --trainer.strategy.help lightning_decentral.DecentralizedStrategy" in text
    assert "not a registered name such as dpsgd" in text


@pytest.mark.parametrize(
    "strategy, options",
    [
        ("lightning_decentral.DecentralizedStrategy", ["gossip_steps", "topology", "gossip_dtype", "start_method"]),
        ("lightning_decentral.SimulatedDecentralizedStrategy", ["gossip_steps", "topology", "gossip_dtype", "workers"]),
    ],
)
def test_strategy_help_lists_the_strategy_options(strategy: str, options: list[str], run_cli) -> None:
    """What the `--help` hint says works: the strategy's own arguments, by class path."""
    code, out, _ = run_cli(["fit", "--trainer.strategy.help", strategy])
    assert code == 0
    for option in options:
        assert f"--trainer.strategy.{option}" in out, option


SIMULATED = str(ROOT / "examples" / "configs" / "digits_simulated.yaml")


@pytest.mark.parametrize(
    "args, first",
    [
        (
            ["--trainer.strategy.init_args.topology", "rnig"],
            "trainer.strategy.init_args.topology: Unknown topology 'rnig'. Choose one of [",
        ),
        (
            ["--trainer.strategy.init_args.workers", "0"],
            "trainer.strategy.init_args.workers: `workers` must be a positive integer",
        ),
        (
            ["--trainer.strategy.init_args.gossip_steps", "-1"],
            "trainer.strategy.init_args.gossip_steps: `gossip_steps` must be a positive integer",
        ),
    ],
    ids=["topology", "workers", "gossip_steps"],
)
def test_a_bad_strategy_option_shows_the_librarys_message_first(args: list[str], first: str, run_cli) -> None:
    """Before: a 50-line usage, then a list of Union subtypes (`Expected a path but rnig either not accessible...`), the
    library's message at the end of a Namespace dump or not at all."""
    code, _, err = run_cli(["fit", "--config", SIMULATED, *args])
    assert code == 2
    assert err.startswith(f"error: {first}"), err[:500]
    assert err.splitlines()[0].endswith(".") and "usage:" not in err


@pytest.mark.parametrize(
    "strategy", ["lightning_decentral.DecentralizedStrategy", "lightning_decentral.SimulatedDecentralizedStrategy"]
)
def test_strategy_help_describes_every_option_and_lists_the_topologys_real_choices(strategy: str, run_cli) -> None:
    """Before: some 30 "known subclasses" of numpy and torch for `topology`; no description of `gossip_every`, ... ."""
    import inspect

    from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy

    code, out, _ = run_cli(["fit", "--trainer.strategy.help", strategy])
    assert code == 0
    blocks = dict(re.findall(r"^  --trainer\.strategy\.(\w+)[^\n]*\n((?: {24}.*\n)+)", out, re.M))
    cls = DecentralizedStrategy if strategy.endswith(".DecentralizedStrategy") else SimulatedDecentralizedStrategy
    for name in inspect.signature(cls).parameters:
        assert name in blocks, name
        description = " ".join(blocks[name].split())
        assert not description.startswith("(type:"), f"{name} has no description"
    choices = " ".join(blocks["topology"].split())
    known = choices.split("known subclasses:")[1]
    assert "lightning_decentral.Torus" in known and "'one_peer_exponential'" in choices
    assert "numpy." not in known and "torch." not in known


def _doc_examples() -> list[tuple[str, list[str]]]:
    """The examples of docs/quickstart.md: a ```text block of `$ lightning-decentral ...`, then what it prints."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    blocks = re.findall(r"```text\n\$ (lightning-decentral [^\n]*)\n(.*?)```", text, re.S)
    return [(command, printed.splitlines()) for command, printed in blocks]


def _prints(expected: list[str], actual: str) -> bool:
    """Whether `actual` is the `expected` lines from its first line on, a `...` line standing for any lines (runs of
    whitespace compare as one space)."""
    pattern = "".join(
        "(?:.*\n)*?" if line.strip() == "..." else re.escape(" ".join(line.split())) + "\n" for line in expected
    )
    return re.fullmatch(pattern, "".join(" ".join(line.split()) + "\n" for line in actual.splitlines())) is not None


def test_the_quickstart_shows_errors_to_compare() -> None:
    assert len(_doc_examples()) >= 4


@pytest.mark.parametrize(
    "command, expected", _doc_examples(), ids=lambda value: value if isinstance(value, str) else ""
)
def test_the_quickstarts_error_examples_are_what_the_command_prints(
    command: str, expected: list[str], run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ~50 lines of usage, then the error, no close match; the page showed a message no longer printed."""
    monkeypatch.chdir(ROOT)
    code, _, err = run_cli(shlex.split(command)[1:])
    assert code == 2
    assert _prints(expected, err), err
    assert "usage:" not in err and "Traceback" not in err


def test_a_typo_in_a_config_files_key_names_the_close_match(tmp_path: Path, run_cli) -> None:
    (tmp_path / "typo.yaml").write_text("trainer:\n  max_epohcs: 3\n")
    code, _, err = run_cli(["fit", "--config", QUICKSTART, "--config", str(tmp_path / "typo.yaml")])
    assert code == 2
    assert err.startswith(
        "error: Subcommand 'fit' does not accept option 'trainer.max_epohcs'. Did you mean trainer.max_epochs?\n"
    )


@pytest.mark.parametrize(
    "args, first",
    [
        (
            ["--trainer.strategy", "dpsdg"],
            "trainer.strategy: 'dpsdg' is not a registered strategy name. Did you mean 'dpsgd'?",
        ),
        (
            ["--model.lrr", "0.1"],
            "model.init_args.lrr: examples.digits.DigitsCNN has no option 'lrr'. Did you mean 'lr'?",
        ),
        (
            ["--trainer.strategy.init_args.on_peer_failure", "contnue"],
            "trainer.strategy.init_args.on_peer_failure: 'contnue' is not one of 'stop', 'continue'. Did you mean "
            "'continue'?",
        ),
        (
            ["--trainer.strategy.init_args.gossip_every", "two"],
            "trainer.strategy.init_args.gossip_every: Expected a <class 'int'>. Got value: two",
        ),
    ],
    ids=["strategy-name", "model-option", "literal", "type"],
)
def test_a_typo_gives_the_line_that_matters_first(
    args: list[str], first: str, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # examples.digits imports from the repository root
    code, _, err = run_cli(["fit", "--config", QUICKSTART, *args])
    assert code == 2
    assert err.splitlines()[0] == f"error: {first}", err[:500]
    assert "usage:" not in err


OUTER_YAML = """
trainer:
  strategy:
    class_path: lightning_decentral.SimulatedDecentralizedStrategy
    init_args:
      workers: 4
      topology: complete
      gossip_every: 2
      outer_optimizer:
        class_path: torch.optim.SGD
        init_args: {lr: 0.7, momentum: 0.9, nesterov: true}
"""


@pytest.mark.slow
def test_an_outer_optimizer_in_yaml_reaches_the_strategy_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DiLoCo from a config file: `outer_optimizer` by `class_path` and `init_args`, as Lightning's optimizers."""
    import torch

    from lightning_decentral.cli import DecentralizedCLI

    monkeypatch.setattr(sys, "argv", ["lightning-decentral"])
    (tmp_path / "outer.yaml").write_text(OUTER_YAML)
    cli = DecentralizedCLI(
        args=[
            "--config",
            QUICKSTART,
            "--config",
            str(tmp_path / "outer.yaml"),
            "--trainer.devices",
            "1",
            "--trainer.max_steps",
            "4",
            "--trainer.logger",
            "false",
            "--trainer.callbacks",
            "[]",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
        run=False,
    )
    strategy = cli.trainer.strategy
    built = strategy.options.outer_optimizer([torch.zeros(1, requires_grad=True)])
    assert type(built) is torch.optim.SGD and built.defaults["nesterov"] and built.defaults["lr"] == 0.7
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert strategy.rule == "outer" and cli.trainer.global_step == 4
    modules = strategy.worker_modules()
    for module in modules[1:]:  # DiLoCo: one anchor, every worker restarted from it at step 4
        for a, b in zip(modules[0].parameters(), module.parameters()):
            assert torch.equal(a, b)


def test_an_outer_optimizer_on_the_command_line_prints_as_yaml(run_cli) -> None:
    code, out, err = run_cli(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.strategy.init_args.outer_optimizer",
            "torch.optim.SGD",
            "--trainer.strategy.init_args.outer_optimizer.lr",
            "0.7",
            "--print_config",
        ]
    )
    assert code == 0, err
    assert "outer_optimizer:\n        class_path: torch.optim.SGD\n        init_args:\n          lr: 0.7" in out


def test_a_registered_strategy_name_takes_options_of_its_own(run_cli) -> None:
    """Before: `--trainer.strategy decentlam --trainer.strategy.compression sign` gave only `Expected a <class 'str'>`
    (a name is a string, which takes no option)."""
    options = ["--trainer.strategy", "dpsgd", "--trainer.strategy.compression", "sign"]
    code, out, _ = run_cli(["fit", "--config", QUICKSTART, *options, "--print_config"])
    assert code == 0
    assert "class_path: lightning_decentral.trainer.strategy.DecentralizedStrategy" in out
    assert "compression: sign" in out and "momentum: local" in out
    code, out, err = run_cli(
        ["fit", "--config", QUICKSTART, "--trainer.strategy", "decentlam", "--trainer.strategy.compression", "sign"]
    )
    assert code == 2
    first = err.splitlines()[0]
    assert first.startswith("error: trainer.strategy.init_args.compression: compression=Sign")
    assert "momentum='decentlam'" in first and "use momentum='local'" in first


def test_a_typo_inside_the_outer_optimizers_init_args_names_the_close_match(tmp_path: Path, run_cli) -> None:
    """Before: the parser's account only (`Option 'momentom' is not accepted`), no suggestion."""
    config = tmp_path / "outer.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            trainer:
              strategy:
                class_path: lightning_decentral.DecentralizedStrategy
                init_args:
                  gossip_every: 4
                  outer_optimizer:
                    class_path: torch.optim.SGD
                    init_args: {lr: 0.7, momentom: 0.9}
            """
        )
    )
    code, _, err = run_cli(["fit", "--config", QUICKSTART, "--config", str(config), "--print_config"])
    assert code == 2
    assert err.splitlines()[0] == (
        "error: trainer.strategy.init_args.outer_optimizer.init_args.momentom: torch.optim.SGD has no option "
        "'momentom'. Did you mean 'momentum'?"
    )


def test_print_config_with_comments_prints_each_options_help(run_cli) -> None:
    """Before: `--print_config=comments` was refused (`Invalid option "comments"`: ruamel.yaml was not a dependency)."""
    code, out, _ = run_cli(["fit", "--config", QUICKSTART, "--print_config=comments"])
    assert code == 0
    assert "# gossip on steps with `(k + 1) % gossip_every == 0`" in out and "gossip_every: 1" in out
