"""The command line: ``comera pretrain | evaluate | export`` and ``comera-pretrain``.

Heavy imports (torch, deepspeed, datasets) happen inside the commands so ``--help`` is instant.
Bad input (a missing file, an invalid config, an empty corpus, a tokenizer/model mismatch,
a sequence longer than the model's positions, an unreadable cache) prints ONE line on stderr
and exits with status 2; the checks run before anything is written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence

EXIT_BAD_INPUT = 2

PRETRAIN_HELP = "Pretrain a CoMERA (tensor-train, rank-adaptive) model with DeepSpeed."
EVALUATE_HELP = ("Loss and accuracy of a checkpoint on any local corpus: masked-LM for an MLM run, next-token for "
                 "a causal (GPT) run.")
EXPORT_HELP = "Export a checkpoint: densified HF model, compact TT form, or one consolidated file."
PRETRAIN_EPILOG = """exit status (every rank alike; launch/torchrun.sh, launch/pretrain_local.sh and a Slurm job pass
it on; slurm/pretrain.sh requeues a stopped job only after 0):
  0  done, or stopped by SIGUSR1/SIGTERM after a checkpoint (resume with --resume auto)
  2  bad input: the one-line message names the config key or file
  3  train.max_nonfinite_steps non-finite steps in a row (the last good state is checkpointed), or
     non-finite bf16 gradients applied with deepspeed.bf16_overflow_check=false (no new checkpoint)
  4  every rank of every TT layer died (model size S = 0), or a bond of the TT embedding did (it maps every
     token to zero); no checkpoint of it: lower comera.controller.gamma or comera.lr.gates (for the embedding,
     comera.controller.embedding_tau), then resume"""


def _add_pretrain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="YAML",
                   help="run config: model, comera, data, train, deepspeed and metrics sections "
                        "(see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value by dotted key, the value parsed as YAML "
                        "(e.g. --set train.steps=20 --set deepspeed.zero_stage=3); repeatable")
    p.add_argument("--resume", default=None, metavar="auto|none|PATH",
                   help="auto: continue from the latest complete checkpoint in train.output_dir if any; "
                        "none: start fresh; PATH: that checkpoint, or the newest that verifies under a run directory "
                        "or its checkpoints/ directory. Default: the config's train.resume. A requeued "
                        "Slurm job (SLURM_RESTART_COUNT > 0) whose newest checkpoint it wrote itself resumes "
                        "auto, whatever this says")
    p.add_argument("--dry-run", action="store_true",
                   help="print parameter counts, compression, FLOPs per token and the resolved DeepSpeed "
                        "config, then exit without training or writing anything (status 2, after the summary, "
                        "when comera pretrain would refuse the config, e.g. the six-encoder classifier)")
    p.add_argument("--check-config", action="store_true",
                   help="check the config (every key and value, the arch, the COMERA_* settings, the local files "
                        "it names: data.files, data.tokenizer.pretrained, a --resume path; the checkpoint the run would "
                        "resume, which must fit the config's model and tensorization) and exit, "
                        "without building the model or the batch arithmetic, which needs the world size "
                        "(--dry-run --world-size N checks that): status 0 when comera pretrain would take it, 2 "
                        "with one line naming the problem. For a node where the job's size is not known yet "
                        "(slurm/pretrain.sh --dry-run outside an allocation)")
    p.add_argument("--json", action="store_true",
                   help="with --dry-run: print the summary as one JSON object (machine-readable); with "
                        "--check-config: print the verdict as one, {config, resume, step, train_steps, "
                        "nothing_to_train, problems} (resume: the checkpoint the run would resume, or null; step: "
                        "its step; nothing_to_train: it is at train.steps and its files match its manifest; "
                        "problems: what did not match, else [])")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="with --dry-run: the number of processes to solve the batch arithmetic for "
                        "(default: $WORLD_SIZE or 1)")
    # The deepspeed launcher appends --local_rank=N to the script's arguments; the rank is read
    # from the environment instead, so the value is accepted and ignored.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher; ignored (LOCAL_RANK from the environment is used)")


def build_parser() -> argparse.ArgumentParser:
    """The ``comera`` parser with its three subcommands."""
    parser = argparse.ArgumentParser(
        prog="comera", description="comera-dist: distributed CoMERA pretraining on DeepSpeed.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{pretrain,evaluate,export}")

    _add_pretrain_args(sub.add_parser("pretrain", help=PRETRAIN_HELP, description=PRETRAIN_HELP,
                                      epilog=PRETRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter))

    ev = sub.add_parser("evaluate", help=EVALUATE_HELP, description=EVALUATE_HELP)
    ev.add_argument("--checkpoint", required=True, metavar="DIR",
                    help="a run directory (its latest complete checkpoint is used) or one checkpoint directory")
    ev.add_argument("--data", required=True, nargs="+", metavar="PATH",
                    help="files or directories of .py/.txt/.md/.rst/.json/.jsonl/.parquet text to evaluate on")
    ev.add_argument("--batch-size", type=int, default=8, metavar="N", help="sequences per batch (default 8)")
    ev.add_argument("--max-batches", type=int, default=None, metavar="N",
                    help="stop after N batches (default: the whole corpus)")
    ev.add_argument("--text-column", default=None, metavar="NAME",
                    help="the column of JSON/Parquet rows holding the text (default: the checkpoint's "
                         "data.text_column)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the MLM masking (default 0; a causal run draws nothing)")
    ev.add_argument("--json", action="store_true", help="print the result as one JSON object")

    ex = sub.add_parser("export", help=EXPORT_HELP, description=EXPORT_HELP)
    ex.add_argument("--checkpoint", required=True, metavar="DIR",
                    help="a run directory (its latest complete checkpoint is used) or one checkpoint directory")
    ex.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist or be empty)")
    ex.add_argument("--format", default="dense-hf", choices=["dense-hf", "tt", "consolidated"],
                    help="dense-hf: densified HuggingFace transformers model (save_pretrained); "
                         "tt: the compact TT form (cores + shapes); consolidated: one fp32 state-dict file "
                         "merged from the ZeRO shards (default dense-hf)")
    return parser


def _world_size(arg: int | None) -> int:
    if arg is not None:
        if arg < 1:
            from comera_dist.engine.errors import InputError

            raise InputError(f"--world-size must be >= 1, got {arg}")
        return arg
    raw = os.environ.get("WORLD_SIZE", "1")
    if not raw.isdigit() or int(raw) < 1:
        from comera_dist.engine.errors import InputError

        raise InputError(f"WORLD_SIZE={raw!r} (environment) must be a positive integer; or give --world-size")
    return int(raw)


def pretrain(args: argparse.Namespace) -> int:
    """``comera pretrain``: validate the config, then dry-run or train.

    A training job records Slurm's SIGUSR1 from its first line, before the seconds of imports (torch,
    DeepSpeed) that precede ``train()``: one that arrives then stops the job at its first step with a
    checkpoint, instead of killing the rank or being lost."""
    _check_modes(args)
    if args.check_config:
        return _check_config(args)
    if args.dry_run:
        return _dry_run(args)
    from comera_dist.engine.signals import START_SIGNALS, StopRequest  # imports no torch

    stop = StopRequest(START_SIGNALS)
    try:
        from comera_dist.engine.distributed import leave_distributed
        from comera_dist.engine.trainer import train

        cfg = _checked_config(args)  # the world size is checked once ranks are known
        status = train(cfg, resume=cfg.train.resume, stop=stop)  # every rank returns together (closing barrier)
    finally:
        stop.close()
    leave_distributed()
    return status


def _check_modes(args: argparse.Namespace) -> None:
    """``--json`` and ``--world-size`` shape a dry run's output: without ``--dry-run`` they would be dropped
    while a run trains, or a check passes that the run's world size fails."""
    from comera_dist.engine.errors import InputError

    if args.json and not (args.dry_run or args.check_config):
        raise InputError("--json: only with --dry-run or --check-config (it shapes their output; a run logs)")
    if args.world_size is not None and not args.dry_run:
        raise InputError("--world-size: only with --dry-run (it shapes the dry run's summary; a run takes its "
                         "world size from its launcher)")
    if args.dry_run and args.check_config:
        raise InputError("--dry-run and --check-config are two checks: give one (--dry-run --world-size N also "
                         "checks the batch arithmetic)")


def _dry_run(args: argparse.Namespace) -> int:
    """``comera pretrain --dry-run``: the resolved config and its batch arithmetic, nothing started."""
    from comera_dist.config import check_local_inputs, check_pretrainable
    from comera_dist.configbase import ConfigError
    from comera_dist.engine.summary import format_summary, run_summary

    world_size = _world_size(args.world_size)
    cfg = _checked_config(args, world_size)
    _print_warnings(cfg)
    refused, target = None, None
    try:  # the sizes of any arch are worth a look; whether pretrain would take it is the exit status
        check_pretrainable(cfg)
        target = check_local_inputs(cfg)
    except ConfigError as e:
        refused = e
    plans = target[1].get("plans", []) if target else []  # a resume's sizes: its checkpoint's shapes
    try:
        summary = run_summary(cfg, world_size=world_size, plans=plans)
    except ConfigError as e:
        if not plans:
            raise
        raise ConfigError(f"train.resume: checkpoint {target[0]}: {e}") from None
    if refused is None:  # what a refused config's run would resume is moot
        summary["resume"] = None if target is None else str(target[0])
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    if refused is not None:
        print(f"comera pretrain: error: {refused} (the summary above is for inspection only)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _check_config(args: argparse.Namespace) -> int:
    """``comera pretrain --check-config``: what ``pretrain`` checks before any rank starts, nothing more."""
    from comera_dist.config import check_local_inputs, check_pretrainable
    from comera_dist.engine import checkpoint_layout as layout

    cfg = _checked_config(args)
    check_pretrainable(cfg)  # the batch arithmetic waits for the world size
    target = check_local_inputs(cfg)
    _print_warnings(cfg)
    if args.json:  # slurm/pretrain.sh asks it whether a requeue would train anything (launch/preflight.sh)
        step = None if target is None else target[1].get("step")
        # A final checkpoint whose files do not match its manifest reads as finished by its meta alone, yet the
        # run's ``resume auto`` walks back past it and trains on: a requeue skipped on the meta's word loses steps.
        problems = layout.check(target[0]) if _finished(cfg, step) else []
        print(json.dumps({"config": args.config, "resume": None if target is None else str(target[0]), "step": step,
                          "train_steps": cfg.train.steps, "nothing_to_train": _finished(cfg, step) and not problems,
                          "problems": problems}))
        return 0
    start = "starts fresh" if target is None else f"resumes {target[0]} if it verifies{_nothing_left(cfg, target[1])}"
    print(f"comera pretrain: {args.config}: config accepted, {start} (the batch arithmetic is checked at the run's "
          "world size: --dry-run --world-size N)")
    return 0


def _finished(cfg, step: object) -> bool:
    """Whether a run resuming a checkpoint of ``step`` is already at ``train.steps`` (the trainer's "nothing to
    train")."""
    return isinstance(step, int) and step >= cfg.train.steps


def _nothing_left(cfg, meta: dict) -> str:
    """What the run would say after resuming the checkpoint of ``meta``, when its step is already ``train.steps``."""
    step = meta.get("step")
    if not _finished(cfg, step):
        return ""
    return f", at step {step} of train.steps={cfg.train.steps}: nothing to train (--set train.steps=N trains on)"


def _print_warnings(cfg) -> None:
    from comera_dist.config import run_warnings

    for line in run_warnings(cfg):
        print(f"comera pretrain: warning: {line}", file=sys.stderr)


def _checked_config(args: argparse.Namespace, world_size: int | None = None):
    """The run config of ``args`` (with ``world_size``, its batch arithmetic too) and the ``COMERA_*`` settings
    (``COMERA_KERNELS``, ``COMERA_RANK_ALIGN``, ``COMERA_FFN_ROWS``) checked, before any rank starts: a bad one is
    one line, not a traceback at the first step."""
    from comera_dist.config import load_run_config
    from comera_dist.kernels.dispatch import check_environment

    cfg = load_run_config(args.config, _overrides(args), world_size=world_size)
    check_environment()
    return cfg


def _overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` overrides, and ``--resume`` as ``train.resume``: quoted, so a path is taken as written (as YAML,
    ``#1`` would be a comment and ``2024`` a number)."""
    return list(args.overrides) + ([f"train.resume={json.dumps(args.resume)}"] if args.resume is not None else [])


def evaluate(args: argparse.Namespace) -> int:
    """``comera evaluate``: the masked-LM (or causal-LM) loss and accuracy of a checkpoint on local files."""
    with _stdout_is_the_result():
        from comera_dist.engine.evaluate import evaluate_checkpoint

        result = evaluate_checkpoint(args.checkpoint, args.data, batch_size=args.batch_size,
                                     max_batches=args.max_batches, seed=args.seed, text_column=args.text_column)
    if args.json:
        print(json.dumps(result))
    else:
        scored = "masked tokens" if result["objective"] == "mlm" else "next-token predictions"
        print(f"loss {result['loss']:.4f}  accuracy {result['accuracy']:.4f}  "
              f"({result['masked_tokens']} {scored} in {result['batches']} batches)")
    return 0


def export(args: argparse.Namespace) -> int:
    """``comera export``: write a checkpoint in the requested format."""
    with _stdout_is_the_result():
        from comera_dist.engine.evaluate import export_checkpoint

        path = export_checkpoint(args.checkpoint, args.out, fmt=args.format)
    print(path)
    return 0


def _stdout_is_the_result() -> contextlib.AbstractContextManager:
    """Everything printed meanwhile goes to stderr: stdout is the command's result alone (one JSON object, a
    path), for scripts. DeepSpeed's logger writes to stdout (its accelerator warning at import, zero_to_fp32's
    progress), and binds that stream when first imported, which happens in here for these commands."""
    return contextlib.redirect_stdout(sys.stderr)


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from comera_dist.configbase import ConfigError
    from comera_dist.engine.errors import InputError
    from comera_dist.kernels.dispatch import SettingError

    return (ConfigError, InputError, SettingError, FileNotFoundError, FileExistsError, NotADirectoryError,
            IsADirectoryError, PermissionError)


def _run(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return command(args)
    except _bad_input_types() as e:
        msg = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.strerror}: {e.filename}"
        print(f"comera {args.command}: error: {msg}".replace("\n", " "), file=sys.stderr)
        return EXIT_BAD_INPUT


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "pretrain": pretrain, "evaluate": evaluate, "export": export}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``comera``."""
    args = build_parser().parse_args(argv)
    return _run(COMMANDS[args.command], args)


def pretrain_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``comera-pretrain`` and ``launch/train.py``: ``comera pretrain``."""
    parser = argparse.ArgumentParser(prog="comera-pretrain", description=PRETRAIN_HELP, epilog=PRETRAIN_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_pretrain_args(parser)
    args = parser.parse_args(argv)
    args.command = "pretrain"
    return _run(pretrain, args)


if __name__ == "__main__":
    sys.exit(main())
