"""Train a LoRA for Stable Diffusion: python train_network.py --config lora.toml [--option value ...]"""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from library.config import Config


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """Run the command line `argv`; `own_process`: this process runs nothing else, so what it imports may be
    narrowed to what the run uses."""
    import library.families.registry  # noqa: F401 - adds the families' options to the schema
    from library.config import UserError, parse_config, write_config
    from library.data.dataset_config import dataset_toml_problems

    try:
        config, notes = parse_config(argv, extra_checks=[dataset_toml_problems])
    except UserError as e:
        return _report(e)
    if config.output_config is not None:
        write_config(config, config.output_config)
        print(f"wrote the resolved configuration to {config.output_config}")
        return 0

    if config.dataset_check:
        from library.data.check import dataset_report
        from library.families.loading import caption_tokenizer
        from library.families.registry import entry_for

        tokenizer = caption_tokenizer(config.pretrained_model_name_or_path, config.model_config)
        model = config.pretrained_model_name_or_path
        text, usable = dataset_report(config, tokenizer, frames_rule=entry_for(model).frames_rule if model else None)
        print(text)
        return 0 if usable else 2

    hidden = hide_unused_packages(config) if own_process else []
    rank = int(os.environ.get("RANK", "0"))
    log_format = {"fmt": "%(asctime)s %(levelname)s %(name)s: %(message)s", "datefmt": "%H:%M:%S"}
    if config.console_log_file and rank == 0:
        # kohya's console_log_file: the log goes to this file (written anew) instead of the console
        handler = logging.FileHandler(config.console_log_file, mode="w", encoding="utf-8")
        handler.setFormatter(logging.Formatter(**log_format))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(config.console_log_level)
    else:
        logging.basicConfig(level=config.console_log_level if rank == 0 else logging.WARNING,
                            format=log_format["fmt"], datefmt=log_format["datefmt"])
    # accelerate logs every file of every save at INFO; our own log already says what was saved.
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    for note in notes:
        logging.getLogger("config").info(note)
    if hidden:
        logging.getLogger("startup").debug("not imported, unused by this run: %s", ", ".join(hidden))

    from library.training import loop
    from library.training.faults import Interrupted, OutsideSteps

    try:
        with OutsideSteps():  # SIGTERM / SIGINT while loading, caching or saving: one line, not a traceback
            loop.run(config)
    except UserError as e:
        return _report(e)
    except Interrupted as e:
        print(e.message, file=sys.stderr)
        return e.status
    except KeyboardInterrupt:  # raised by other means than our handlers
        print("stopped by SIGINT outside the training steps; the files already saved are kept", file=sys.stderr)
        return 130
    return 0


def hide_unused_packages(config: Config) -> list[str]:
    """Hide installed packages the run does not use from the libraries that import whatever is installed.

    A name set to None in sys.modules reads as not installed to importlib.util.find_spec, which is how diffusers,
    transformers, peft and accelerate ask before importing an optional package. Hidden here:
    - bitsandbytes, unless the optimizer is one of its own or it stores the base (int8, nf4): those libraries
      import it whenever it is installed, and it brings torch's compiler stack with it (about a second and 45 MiB
      at start-up);
    - scipy, unless the run samples images (a sample prompt may ask for the LMS sampler, which uses it) or builds
      an optimizer or scheduler from a package not known to do without it: transformers imports it for
      object-detection losses (about 55 MiB);
    - boto3, which accelerate imports for its SageMaker configuration (about 7 MiB).
    """
    from library.training.optim import optimizer_package

    # Once imported, those libraries have recorded what is installed and would fail to import a hidden package.
    askers = ("diffusers", "transformers", "peft", "accelerate", "bitsandbytes", "scipy", "boto3")
    if any(name in sys.modules for name in askers):
        return []
    optimizer = optimizer_package(config)  # None: a name its own check refuses; nothing is hidden meanwhile
    scheduler = ((config.lr_scheduler_type or "").rpartition(".")[0] or "torch").split(".")[0]  # "StepLR": torch's
    without_scipy = {"torch", "transformers", "diffusers", "lion_pytorch", "prodigyopt", "dadaptation", "schedulefree"}
    quantized_base = config.base_model_precision in ("int8", "nf4")
    unused = {"bitsandbytes": optimizer not in ("bitsandbytes", None) and not quantized_base,
              "scipy": not config.sample_prompts and optimizer in without_scipy and scheduler in without_scipy,
              "boto3": True}
    hidden = [name for name, hide in unused.items() if hide]
    for name in hidden:
        sys.modules[name] = None
    return hidden


def _report(error: Exception) -> int:
    problems = getattr(error, "problems", [str(error)])
    print(f"error: {len(problems)} problem{'s' if len(problems) > 1 else ''}:" if len(problems) > 1 else "error:",
          file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        status = main(own_process=True)
    except KeyboardInterrupt:  # Ctrl-C while the libraries load
        print("stopped by SIGINT before training started", file=sys.stderr)
        status = 130
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # The process group is already destroyed; gloo can still abort in interpreter teardown after a finished run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
