"""`lightning-decentral`: Lightning's `LightningCLI` with the decentralized strategies registered.

    lightning-decentral fit --config examples/configs/digits_dpsgd.yaml
    lightning-decentral fit --config examples/configs/digits_dpsgd.yaml --trainer.max_epochs 5
    lightning-decentral fit --config examples/configs/digits_dpsgd.yaml --print_config
    lightning-decentral validate --config examples/configs/digits_dpsgd.yaml --ckpt_path last.ckpt

Subcommands `fit`, `validate`, `test`, `predict`. `model` and `data` take any LightningModule and
LightningDataModule by `class_path` (subclass mode), `trainer.strategy` a registered name (`dpsgd`,
`decentlam`, `ddp`...) or `class_path: lightning_decentral.DecentralizedStrategy` with `init_args`.

`lightning-decentral --help` and `lightning-decentral fit --help` list every option but the strategy's
own, which depend on the class chosen; show those with `--trainer.strategy.help`, which takes a class
path or a class name (not a registered name such as `dpsgd`):

    lightning-decentral fit --trainer.strategy.help lightning_decentral.DecentralizedStrategy
    lightning-decentral fit --trainer.strategy.help lightning_decentral.SimulatedDecentralizedStrategy

Like `python -m`, the command puts the current directory first on `sys.path`, so that
`class_path: examples.digits.DigitsCNN` imports when run from the repository root; modules on
`PYTHONPATH` import as well. After `fit`, rank 0 prints the validation metrics of the final model
(the averaged model `x̄` under `DecentralizedStrategy`'s default `eval_on="average"`), where the logs
and checkpoints are, and the plots [`plot_runs`][lightning_decentral.plot.plot_runs] drew.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_decentral.measures import Monitored

DESCRIPTION = (
    "lightning-decentral: Lightning's command line (LightningCLI) with the decentralized (gossip) strategies "
    "registered. It runs fit, validate, test or predict on any LightningModule and LightningDataModule given "
    "by class_path; --trainer.strategy takes a registered name (dpsgd, decentlam, dpsgd_sim, ddp...) or a "
    "class_path with init_args."
)
"""What `lightning-decentral --help` says the command is."""

STRATEGY_HELP = (
    "The strategy's own options (topology, gossip_steps, gossip_dtype, ...) are not listed in --help; show "
    "them with: lightning-decentral fit --trainer.strategy.help lightning_decentral.DecentralizedStrategy "
    "(or lightning_decentral.SimulatedDecentralizedStrategy). That flag takes a class path or a class name, "
    "not a registered name such as dpsgd."
)
"""The hint, in every `--help`, to see the strategy's options."""


class DecentralizedParser(LightningArgumentParser):
    """`LightningArgumentParser` whose errors fit on a screen: the one line that matters first (the option's path,
    what is wrong, the close match of a misspelled option or choice: [`headline`][lightning_decentral.cli.headline]),
    then the parser's own account, without the usage of every option. `JSONARGPARSE_DEBUG=true` raises instead."""

    def error(self, message: str, ex: Exception | None = None, first: str | None = None) -> NoReturn:
        """Write `first` (default: the headline of `message`), then `message` if it says more; exit with code 2."""
        if not self.exit_on_error or _debugging():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self  # as jsonargparse finds the parser that failed
        options = sorted(set(re.findall(r"--[\w.]+", parser.format_usage())))  # every option the command takes
        first = first or headline(message, options)
        account = "" if message.strip() in first else f"\nThe parser's account of it:\n{message.rstrip()}\n"
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {first}\n{account}\n`{prog} --help` lists every option.\n")
        self.exit(2)


def _debugging() -> bool:
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true"  # jsonargparse refuses any other value


_KEY = re.compile(r'(?:- )?Parser key "([^"]+)":$')
_CLASS = re.compile(r"(?:- )?Problem with given class_path '([^']+)':$")
_NOISE = re.compile(r"(?:Does not validate against any of the Union subtypes|Subtypes:|Errors:|Given value type:)")
_GIVEN = re.compile(r"Given value: (.*)$")
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$")
_OPTION = re.compile(r"Option '([^']+)' is not accepted")
_NESTED_CLASS = re.compile(r"Got value: Namespace\(class_path='([^']+)'")  # a class inside an option (outer_optimizer)
_UNRECOGNIZED = re.compile(r"[Uu]nrecognized arguments: (\S+)|does not accept option '([^']+)'")  # command line, file
_UNREGISTERED = re.compile(r"invalid (strategy|accelerator) name: `\w+='([^']*)'`")  # Lightning's registries
_REGISTERED = {
    "strategy": lambda: StrategyRegistry.available_strategies(),
    "accelerator": lambda: AcceleratorRegistry.available_accelerators(),
}


def headline(message: str, options: list[str] | None = None) -> str:
    """The one line of a jsonargparse error `message` that matters: the deepest error in its tree of `Parser key`
    and `class_path` entries, with the path of the option it concerns, and the close match of a misspelled
    `Literal` value, option of a class, or command-line option (one of `options`).

    Examples:
        >>> message = '''Parser key "trainer.strategy":
        ...   Does not validate against any of the Union subtypes
        ...   Errors:
        ...     - Expected a <class 'str'>
        ...     - Problem with given class_path 'lightning_decentral.DecentralizedStrategy':
        ...         Parser key "combine":
        ...           Expected a typing.Literal['awc', 'atc']. Got value: acw
        ...   Given value type: <class 'jsonargparse._util.NestedArg'>'''
        >>> headline(message)
        "trainer.strategy.init_args.combine: 'acw' is not one of 'awc', 'atc'. Did you mean 'awc'?"
        >>> headline("unrecognized arguments: --trainer.max_epohcs 3", ["--trainer.max_epochs", "--trainer.max_steps"])
        'unrecognized arguments: --trainer.max_epohcs 3. Did you mean --trainer.max_epochs?'
        >>> nested = ("Type Callable expects a function or a callable class: Option 'momentom' is not accepted. "
        ...           "Got value: Namespace(class_path='torch.optim.SGD', init_args=Namespace(momentom=0.9))")
        >>> headline(f'''Parser key "outer_optimizer":
        ...   - {nested}''')
        "outer_optimizer.init_args.momentom: torch.optim.SGD has no option 'momentom'. Did you mean 'momentum'?"
    """
    stack: list[tuple[int, str, str | None]] = []  # (indent, path component, class_path) of the open entries
    deepest: tuple[int, list[str], str | None, str] | None = None
    given = None
    for line in message.splitlines():
        text, indent = line.strip(), len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if key := _KEY.match(text):
            stack.append((indent, key[1], None))
        elif class_path := _CLASS.match(text):
            stack.append((indent, "init_args", class_path[1]))
        elif value := _GIVEN.match(text):
            given = given or value[1]
        elif text and not _NOISE.match(text) and (deepest is None or len(stack) > deepest[0]):
            classes = [entry[2] for entry in stack if entry[2] is not None]
            deepest = (
                len(stack),
                [entry[1] for entry in stack],
                classes[-1] if classes else None,
                text.removeprefix("- "),
            )
    if deepest is None:
        return message.strip().splitlines()[0] if message.strip() else message
    _, path, class_path, text = deepest
    where = ".".join(path)
    if (literal := _LITERAL.match(text)) and (choices := _literals(literal[1])):
        value = literal[2]
        text = f"{value!r} is not one of {', '.join(map(repr, choices))}." + _did_you_mean(value, choices, repr)
    elif option := _OPTION.search(text):
        name, nested = option[1], _NESTED_CLASS.search(text)
        if nested:  # an option of the class an option holds: trainer.strategy.init_args.outer_optimizer.init_args.x
            class_path, where = nested[1], f"{where}.init_args"
        where = f"{where}.{name}" if where else name
        text = f"{class_path or 'the class'} has no option {name!r}." + _did_you_mean(
            name, _parameters(class_path), repr
        )
    elif unregistered := _UNREGISTERED.search(text):
        kind, name = unregistered[1], unregistered[2]
        where = f"trainer.{kind}"
        text = f"{name!r} is not a registered {kind} name." + _did_you_mean(name, list(_REGISTERED[kind]()), repr)
    elif unrecognized := _UNRECOGNIZED.search(text):
        name = (unrecognized[1] or unrecognized[2]).split("=")[0]
        dashes = "--" if name.startswith("--") else ""
        known = [option.lstrip("-") for option in options or []]
        text = text.rstrip(".") + "." + _did_you_mean(name.lstrip("-"), known, lambda option: dashes + option)
    elif given is not None and "Got value" not in text and not given.startswith(("NestedArg(", "Namespace(")):
        text = f"{text.rstrip('.')}. Got value: {given}"
    return f"{where}: {text}" if where else text


def strategy_by_class(args: list[str]) -> list[str]:
    """`args` with `--trainer.strategy NAME` (a name of Lightning's `StrategyRegistry`: `dpsgd`, `decentlam`,
    `dpsgd_sim`, `ddp`, ...) replaced by the class it names and the arguments it registers, when options of the
    strategy follow (`--trainer.strategy.compression sign`): a name is a string, which takes no options, so the
    parser would refuse them with only `Expected a <class 'str'>`. The options given later override the registered
    ones.

    Examples:
        >>> import lightning_decentral
        >>> args = ["fit", "--trainer.strategy", "decentlam", "--trainer.strategy.compression", "sign"]
        >>> print(*strategy_by_class(args))
        fit --trainer.strategy lightning_decentral.trainer.strategy.DecentralizedStrategy
        --trainer.strategy.init_args.momentum decentlam --trainer.strategy.init_args.start_method popen
        --trainer.strategy.compression sign
        >>> strategy_by_class(["fit", "--trainer.strategy=dpsgd"])  # no option of its own: the name stays
        ['fit', '--trainer.strategy=dpsgd']
    """
    flag = "--trainer.strategy"
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            name, end = args[index + 1], index + 2
        elif arg.startswith(f"{flag}="):
            name, end = arg.split("=", 1)[1], index + 1
        else:
            continue
        options = [a for a in args[end:] if a.startswith(f"{flag}.") and not a.startswith(f"{flag}.help")]
        if name not in StrategyRegistry or not options:
            return args
        entry = StrategyRegistry[name]
        registered = [
            part for key, value in entry["init_params"].items() for part in (f"{flag}.init_args.{key}", str(value))
        ]
        cls = entry["strategy"]
        return [*args[:index], flag, f"{cls.__module__}.{cls.__qualname__}", *registered, *args[end:]]
    return args


def _literals(written: str) -> list[Any]:
    """The values of a `Literal[...]` as its repr writes them (none if they are not Python literals)."""
    try:
        return list(ast.literal_eval(f"[{written}]"))
    except (ValueError, SyntaxError):
        return []


def _did_you_mean(value: str, choices: list[Any], show: Any) -> str:
    """` Did you mean X?` with the close match of `value` among `choices` (as `show` writes it), or nothing."""
    names = {str(choice): choice for choice in choices}
    match = difflib.get_close_matches(str(value), list(names), n=1)
    return f" Did you mean {show(names[match[0]])}?" if match else ""


def _parameters(class_path: str | None) -> list[str]:
    """The constructor arguments of the class at `class_path` (none if it does not import)."""
    if class_path is None or "." not in class_path:
        return []
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return [
            p.name
            for p in inspect.signature(cls).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


class DecentralizedCLI(LightningCLI):
    """`LightningCLI` in subclass mode for model and data, reporting on the averaged model after `fit`.

    Args:
        args: the command line (default `sys.argv[1:]`), as for `LightningCLI`.
        **kwargs: any other `lightning.pytorch.cli.LightningCLI` argument.
    """

    def __init__(self, args: ArgsType = None, **kwargs: Any) -> None:
        self._last_validation = _LastValidation()
        kwargs.setdefault("model_class", LightningModule)
        kwargs.setdefault("datamodule_class", LightningDataModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("parser_class", DecentralizedParser)
        super().__init__(args=args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """The parser of the command (described by `DESCRIPTION`) or of a subcommand; each `--help` ends its
        description with `STRATEGY_HELP`."""
        description = kwargs.get("description") or DESCRIPTION  # a subcommand's: the Trainer method's first line
        kwargs["description"] = f"{description} {STRATEGY_HELP}"
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse the command line (a registered strategy name given options of its own becomes its class:
        [`strategy_by_class`][lightning_decentral.cli.strategy_by_class]); a strategy is built through
        `_build_strategy`, which keeps its error."""
        parser.add_instantiator(self._build_strategy, Strategy, subclasses=True)
        given = sys.argv[1:] if args is None else args
        rewritten = strategy_by_class(given) if isinstance(given, list) else given
        if rewritten is given:
            super().parse_arguments(parser, args)
        else:  # the command line, rewritten: Lightning would warn that both args and sys.argv are given
            self.config = parser.parse_args(rewritten)

    def _build_strategy(self, strategy_class: type, *args: Any, **kwargs: Any) -> Strategy:
        """`strategy_class(*args, **kwargs)`; a refusal is kept, as `trainer.strategy.init_args.<option>: message`
        (the first argument the message names), to be shown first."""
        try:
            return strategy_class(*args, **kwargs)
        except (ValueError, TypeError) as error:
            text = str(error)
            named = [(text.find(name), name) for name in kwargs if re.search(rf"\b{name}\b", text)]
            path = "trainer.strategy.init_args" + (f".{min(named)[1]}" if named else "")
            self._refused = f"{path}: {text}"
            raise

    def instantiate_classes(self) -> None:
        """Create model, data and Trainer; an error in a constructor (a bad value in the config, a
        topology that does not fit the world size) exits like a parse error: the message, no traceback
        (`JSONARGPARSE_DEBUG=true` raises it instead). A strategy's own error comes first, on one line with the
        option's path, before the parser's account of it."""
        self._refused: str | None = None
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException) as error:
            parser = self._parser(self.subcommand)
            message = f"The configuration could not be instantiated: {error}"
            if isinstance(parser, DecentralizedParser):
                parser.error(message, error, first=self._refused)
            parser.error(message, error)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        trainer.callbacks.append(self._last_validation)
        return trainer

    def after_fit(self) -> None:
        """Validate the final model unless the last validation already saw it, then report on rank 0."""
        trainer = self.trainer
        if trainer.interrupted:  # Ctrl-C: Lightning stopped the fit and the user wants out
            return
        metrics: dict[str, float] = {}
        if self._has_validation():
            if self._last_validation.step != trainer.global_step:
                trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        if trainer.is_global_zero:
            print(_report(trainer, metrics, _plot(trainer)), flush=True)

    def _has_validation(self) -> bool:
        sources = [self.model] + ([self.datamodule] if self.datamodule is not None else [])
        return (
            bool(self.trainer.limit_val_batches)
            and is_overridden("validation_step", self.model)
            and any(is_overridden("val_dataloader", source) for source in sources)
        )


class _LastValidation(Callback):
    """The optimizer step at which validation last ran during `fit` (-1: never)."""

    def __init__(self) -> None:
        self.step = -1

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.step = trainer.global_step


def _plot(trainer: Trainer) -> list[Path]:
    """The monitors' plots, drawn from the CSV log into `<csv log dir>/plots` (rank 0; none without a CSVLogger)."""
    if not trainer.is_global_zero:
        return []
    csv_dirs = [logger.log_dir for logger in trainer.loggers if isinstance(logger, CSVLogger)]
    if not csv_dirs:
        return []
    from lightning_decentral.plot import plot_runs

    return plot_runs(csv_dirs[:1], str(Path(csv_dirs[0]) / "plots"))


def _report(trainer: Trainer, metrics: dict[str, float], plots: list[Path]) -> str:
    """The text printed after `fit`: what was evaluated, the metrics, where logs, checkpoints and plots are."""
    strategy = trainer.strategy
    workers = trainer.world_size
    if isinstance(strategy, Monitored):
        what = "the averaged model x̄" if strategy.eval_on == "average" else "worker 0's own replica"
        rule = {"decentlam": "decentlam", "outer": "local steps with an outer optimizer"}.get(
            strategy.rule, f"dpsgd {strategy.rule}"
        )
        how = f"{rule}, {strategy.topology!r}"
        workers = strategy.num_workers
        if workers > trainer.world_size:  # several workers in each process
            how += ", simulated in one process"
    else:
        what, how = "the model", type(strategy).__name__
    lines = [f"Finished fit after {trainer.global_step} steps on {workers} workers ({how})."]
    if metrics:
        values = ", ".join(f"{k} = {v:.4f}" for k, v in sorted(metrics.items()))
        lines.append(f"Validation of {what}: {values}")
    for logger in trainer.loggers:
        if logger.log_dir is not None:
            lines.append(f"Logs ({type(logger).__name__}): {logger.log_dir}")
    for checkpoint in trainer.checkpoint_callbacks:
        if checkpoint.best_model_path or checkpoint.last_model_path:
            lines.append(f"Checkpoint: {checkpoint.best_model_path or checkpoint.last_model_path}")
    if plots:
        lines.append(f"Plots ({len(plots)}) in {Path(plots[0]).parent}: " + ", ".join(Path(p).name for p in plots))
    return "\n".join(lines)


def main(args: list[str] | None = None) -> None:
    """The `lightning-decentral` console command (`args` defaults to `sys.argv[1:]`)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does: configs may name classes in modules under the cwd
    DecentralizedCLI(args=args)


if __name__ == "__main__":
    main()
