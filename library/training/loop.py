"""run(config): build the session, then the training loop and its periodic actions (validate, sample, save)."""
from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from accelerate.utils import send_to_device
from tqdm.auto import tqdm

from library.config import Config
from library.core import seeds
from library.core.run_files import SAVE_NOW
from library.monitoring.chart import loss_by_timestep_chart, save_png
from library.monitoring.sampling import SamplingModels, sample_images
from library.monitoring.tracking import Trackers
from library.monitoring.validation import evaluating, should_validate, validation_loss, validation_metrics
from library.training import adapters as adapter_training
from library.training import requests
from library.training.accelerator import gathered, loading_whole, prepare_accelerator
from library.training.caching import on_device
from library.training.faults import Interrupted, Preemption, agree, non_finite, non_finite_error, outcome, reported_save
from library.training.hub import HubUploader
from library.training.model import (
    DiffusionModel,
    adapter_files,
    batch_conditioning,
    batch_latents,
    diffusion_loss,
    lora_modules,
    save_lora,
)
from library.training.optim import schedule_free_eval
from library.training.setup import Session, build_session, claim_output_dir
from library.training.state import epoch_name, prune_epochs, prune_steps, state_dir_name, step_name

logger = logging.getLogger(__name__)
_PREPARED_FOR_LIFE: list[torch.nn.Module] = []  # see run()


@dataclass
class RunResult:
    """What a finished run reports back to its caller (tests and benchmarks)."""
    output_file: Path | None  # the LoRA file; None where the run wrote one per adapter (output_files)
    global_step: int
    model: DiffusionModel | None = None  # the unwrapped trained model, for in-process callers
    losses: list[float] = field(default_factory=list)  # each optimizer step's loss, averaged over processes
    validation: dict[int, float] = field(default_factory=dict)  # the last validation loss per timestep
    step_times: list[float] = field(default_factory=list)  # wall seconds of each optimizer step
    output_files: list[Path] = field(default_factory=list)  # the LoRA file, or one file per adapter


def run(config: Config) -> RunResult:
    """Train a LoRA as configured and write it to output_dir/output_name.safetensors."""
    started_at = time.time()
    accelerator = prepare_accelerator(config)
    trackers = Trackers()
    lock = None
    try:
        lock = claim_output_dir(Path(config.output_dir), accelerator)
        if accelerator.is_main_process:
            trackers.open_events(Path(config.output_dir), config.output_name)
        with loading_whole(accelerator):
            session = build_session(config, accelerator, started_at)
        if accelerator.num_processes > 1:
            # Freeing DDP's reducer while gloo's worker thread still releases a finished all-reduce can deadlock
            # (the main thread holds the GIL waiting for the process group's mutex, the worker holds the mutex
            # waiting for the GIL; seen once in a few dozen two-process runs). Keep the wrapped module for the life
            # of the process: multi-process runs end with os._exit, so it is never torn down.
            _PREPARED_FOR_LIFE.append(session.model)
        if accelerator.is_main_process:
            trackers.start(config, started_at)
            trackers.plan(session.plan.total_steps, session.state.global_step, session.plan.num_epochs,
                          session.plan.batches_per_epoch)
        result = Trainer(session, trackers).train()
        trackers.event("end", status="finished", step=result.global_step)
        return result
    except BaseException as e:
        trackers.event("end", **outcome(e))
        raise
    finally:
        trackers.finish()
        if lock is not None:
            lock.release()
        accelerator.end_training()



def epochs_between_saves(config: Config, num_epochs: int) -> int | None:
    """save_every_n_epochs, or with kohya's save_n_epoch_ratio n: every floor(epochs / n) epochs, at least 1."""
    if config.save_n_epoch_ratio:
        return max(1, num_epochs // config.save_n_epoch_ratio)
    return config.save_every_n_epochs

class Trainer:
    """The step loop over a built session, and the actions it takes between steps."""

    def __init__(self, session: Session, trackers: Trackers):
        self.s = session
        self.config = session.config
        self.accelerator = session.accelerator
        self.state = session.state
        self.trackers = trackers
        self.result = RunResult(output_file=None, global_step=session.state.global_step)
        self.validated_at = -1
        self.state_saved_at = -1
        self.preemption = Preemption()
        self.hub = HubUploader(self.config) if self.config.huggingface_repo_id else None
        self.stop_signal: int | None = None  # agreed by every process before the optimizer step
        self.requested = (False,) * len(requests.REQUESTS)  # sample_now / save_now, agreed with the signal
        # Per-batch losses of the optimizer step being accumulated (its samples are in session.metrics).
        self.step_losses: list[torch.Tensor] = []
        # Whether the processes must agree, batch by batch, on running the base model's forward of prior_reg samples.
        self.agree_on_prior = self.accelerator.num_processes > 1 and session.data.has_prior_reg

    # --- the loop ---------------------------------------------------------------------------------------------
    def train(self) -> RunResult:
        s, state, accelerator = self.s, self.state, self.accelerator
        logger.info("%d batches per epoch per process, %d epochs, %d steps", s.plan.batches_per_epoch,
                    s.plan.num_epochs, s.plan.total_steps)
        progress = tqdm(total=s.plan.total_steps, initial=state.global_step, desc="steps",
                        disable=not accelerator.is_main_process, dynamic_ncols=True)
        if s.prompts and self.config.sample_at_first:
            self.sample()
        try:
            with self.preemption if threading.current_thread() is threading.main_thread() else nullcontext():
                self.steps(progress)
        finally:
            progress.close()  # before any message, which would otherwise share the bar's line
        return self.finish()

    def steps(self, progress: tqdm) -> None:
        s, state, accelerator = self.s, self.state, self.accelerator
        step_started = time.perf_counter()
        while state.global_step < s.plan.total_steps and state.epoch < s.plan.num_epochs:
            epoch, first_batch = state.epoch, state.batch_in_epoch
            # Batches are dealt round-robin to processes, so k batches per process are k * world batches overall.
            s.data.sampler.set_epoch(epoch, start_batch=first_batch * accelerator.num_processes,
                                     start_step=state.global_step)
            # accelerate's loader calls set_epoch(its own pass count) when iteration starts: make that count ours.
            s.dataloader.set_epoch(epoch)
            for batch_index, batch in enumerate(s.dataloader, start=first_batch):
                self.accumulate(batch, epoch, batch_index)
                if not accelerator.sync_gradients:
                    continue
                adapter_logs = adapter_training.after_optimizer_step(
                    lora_modules(s.unwrapped, self.config).values(), self.config.scale_weight_norms, s.ema)
                s.lr_scheduler.step()
                state.global_step += 1
                state.batch_in_epoch = batch_index + 1
                if state.batch_in_epoch >= s.plan.batches_per_epoch:
                    state.epoch, state.batch_in_epoch = epoch + 1, 0
                now = time.perf_counter()
                self.result.step_times.append(now - step_started)
                step_started = now
                self.log_step(adapter_logs, progress)
                self.between_steps()
                if state.global_step >= s.plan.total_steps:
                    break
                self.maybe_save()
                self.take_requests()
                if self.stop_signal is not None:
                    self.stop_for(self.stop_signal)
            else:
                # The loader ran out without the step counter wrapping the epoch (an empty remainder).
                if state.epoch == epoch:
                    state.epoch, state.batch_in_epoch = epoch + 1, 0

    def stop_for(self, signum: int) -> None:
        """Preemption: the step is complete; save a state (when states are wanted) and stop."""
        config, state = self.config, self.state
        name = signal.Signals(signum).name
        if not (config.save_state or config.save_state_on_train_end or config.save_state_on_preemption):
            raise Interrupted(signum, f"stopped by {name} after step {state.global_step}; no state saved (set "
                                      "save_state_on_preemption to save one)")
        state_dir = self.s.output_dir / state_dir_name(step_name(config.output_name, state.global_step))
        if self.state_saved_at != state.global_step:
            self.save_snapshot(step_name(config.output_name, state.global_step), True)
        raise Interrupted(signum, f"stopped by {name} after step {state.global_step}; saved {state_dir}; continue "
                                  "with --resume latest")

    def accumulate(self, batch: dict[str, Any], epoch: int, batch_index: int) -> None:
        """One batch: latents -> noise and timesteps -> prediction -> loss -> backward, and the optimizer step
        when the accumulation is complete."""
        s, accelerator, obj = self.s, self.accelerator, self.s.objective
        # Keyed by the batch's position in the epoch's global order (batches are dealt round-robin), so the same
        # batch gets the same noise whatever the number of processes.
        keys = (epoch, batch_index * accelerator.num_processes + accelerator.process_index)
        generator = seeds.step_generator(s.seed, *keys)
        # Dropout draws from the global stream; reseeding it per batch makes it independent of history.
        torch.manual_seed(seeds.torch_seed(s.seed, *keys, 1))
        with accelerator.accumulate(s.model):
            latents = batch_latents(batch, s.components.vae, generator, s.vae_dtype).to(s.weight_dtype)
            noise = obj.sample_noise(latents, generator)
            timesteps = obj.sample_timesteps(latents.shape[0], generator, latents.device, latents.shape[-2:])
            # Passed only when in use, so that wrappers of diffusion_loss (the tests') see the plain call.
            extra: dict[str, torch.Tensor] = {}
            input_noise = obj.input_noise(noise, generator)
            if input_noise is not None:
                extra["input_noise"] = input_noise
            if "loss_mask" in batch:
                extra["mask"] = batch["loss_mask"]
            prior = self.prior_samples(batch)
            if prior is not None:
                extra["prior"] = prior
            with accelerator.autocast():
                conditioning = {**batch_conditioning(s.components.family, batch, s.components.vae, s.vae_dtype),
                                **s.components.family.step_conditioning(latents.shape[0], generator)}
                unweighted = diffusion_loss(s.model, latents, batch["text"], conditioning, noise, timesteps, obj,
                                            **extra)
                per_sample = unweighted * batch["loss_weight"]
                loss = per_sample.mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients and self.config.max_grad_norm:
                accelerator.clip_grad_norm_(s.trainable, self.config.max_grad_norm)
            if accelerator.sync_gradients:
                self.refuse_non_finite(loss)
            s.optimizer.step()
            s.optimizer.zero_grad(set_to_none=True)
        self.step_losses.append(loss.detach())
        s.metrics.add_batch(per_sample, timesteps, prior, unweighted)

    def prior_samples(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """The batch's prior_reg samples as a (batch,) mask, or None when it has none. With several processes, each
        one runs the base model's forward when any one needs it (an all-False mask then): DDP's and ZeRO-3's
        forwards are collectives, so the processes must make the same calls."""
        mask = batch.get("prior_reg")
        if self.agree_on_prior:
            flag = torch.tensor([float(mask is not None)], device=self.accelerator.device)
            if self.accelerator.reduce(flag, reduction="sum").item() and mask is None:
                mask = torch.zeros(len(batch["loss_weight"]), dtype=torch.bool)
        return mask

    def refuse_non_finite(self, loss: torch.Tensor) -> None:
        """Stop before an optimizer step would write NaN/inf into the adapter. With fp16's grad scaler an overflow
        in the gradients is the scaler's to handle (it skips the step), so only the loss is checked then."""
        s, accelerator = self.s, self.accelerator
        losses = [*self.step_losses, loss.detach()]
        bad = non_finite(losses, s.trainable, check_gradients=accelerator.scaler is None)
        # A signal and the requests are agreed on here too, with the same collective; the loop stops or takes them
        # after this step completes.
        bad, self.stop_signal, self.requested = agree(accelerator, bad, self.preemption.signum,
                                                      requests.seen(s.output_dir))
        if bad:
            raise non_finite_error(self.state.global_step, torch.stack(losses).float().mean().item(),
                                   [group["lr"] for group in s.optimizer.param_groups], s.output_dir)

    def log_step(self, adapter_logs: dict[str, float], progress: tqdm) -> None:
        """One collective per step: each process's totals of the step (StepMetrics.totals), added up."""
        s, accelerator, result = self.s, self.accelerator, self.result
        totals = s.metrics.totals(torch.stack(self.step_losses).float().mean())
        self.step_losses.clear()
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
        lrs = dict(zip(s.group_names, (group["lr"] for group in s.optimizer.param_groups), strict=False))
        values = s.metrics.step(totals, accelerator.num_processes, lrs, result.step_times[-1], accelerator.device)
        result.losses.append(values["loss/current"])
        self.trackers.log({**values, **adapter_logs}, step=self.state.global_step)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d loss %.6f lr %s", self.state.global_step, result.losses[-1], list(lrs.values()))
        progress.update(1)
        progress.set_postfix(loss=f"{result.losses[-1]:.4f}", s_per_step=f"{result.step_times[-1]:.3f}",
                             refresh=False)

    # --- between steps ----------------------------------------------------------------------------------------
    def between_steps(self) -> None:
        config, state = self.config, self.state
        epoch_ended = state.batch_in_epoch == 0
        if self.s.data.validation is not None and should_validate(
                state.global_step, epoch_ended, state.epoch, config.validate_every_n_steps,
                config.validate_every_n_epochs):
            self.validate()
        if self.s.prompts:
            sample_epoch = sampling_due(config, state.global_step, epoch_ended, state.epoch)
            if sample_epoch is not False:
                self.sample(sample_epoch)

    def maybe_save(self) -> None:
        config, state, output_dir = self.config, self.state, self.s.output_dir
        main = self.accelerator.is_main_process
        if config.save_every_n_steps and state.global_step % config.save_every_n_steps == 0:
            self.save_snapshot(step_name(config.output_name, state.global_step), config.save_state)
            if main:
                prune_steps(output_dir, config.output_name, state.global_step, config.save_last_n_steps, False)
                prune_steps(output_dir, config.output_name, state.global_step, config.save_last_n_steps_state,
                            True)
        every_n_epochs = epochs_between_saves(config, self.s.plan.num_epochs)
        if state.batch_in_epoch == 0 and every_n_epochs and state.epoch % every_n_epochs == 0:
            self.save_snapshot(epoch_name(config.output_name, state.epoch), config.save_state)
            if main:
                prune_epochs(output_dir, config.output_name, config.save_last_n_epochs, False)
                prune_epochs(output_dir, config.output_name, config.save_last_n_epochs_state, True)

    def take_requests(self) -> None:
        """A sample round or a LoRA file asked for while the step ran (library.training.requests), done now; its
        "request" event says what the trainer is doing until the "samples" or "save" event that ends it."""
        s, config, state = self.s, self.config, self.state
        for name in requests.wanted(self.requested):
            self.trackers.event("request", step=state.global_step, request=name)
            if name == SAVE_NOW:
                self.save_snapshot(step_name(config.output_name, state.global_step), config.save_state)
            elif s.prompts:
                self.sample()
            else:
                logger.warning("%s: the run has no sample prompts (sample_prompts); nothing to sample", name)
            requests.done(self.accelerator, s.output_dir, name)

    def save_snapshot(self, name: str, with_state: bool) -> None:
        s = self.s
        with gathered(self.accelerator, s.trainable):  # ZeRO-3: every process takes part
            if self.accelerator.is_main_process:
                path = s.output_dir / f"{name}.safetensors"
                # A schedule-free optimizer's kept weights, not its training ones; or the EMA when asked.
                saved_weights = s.ema.swapped() if s.ema and self.config.ema_for_saved_file else nullcontext()
                with schedule_free_eval(s.optimizer), saved_weights, reported_save(path, s.output_dir):
                    files = save_lora(self.config, s.unwrapped, s.spec, path, s.metadata(), s.save_dtype)
                for file in files:  # one, or one per adapter of a family that trains several
                    logger.info("saved %s", file)
                    self.trackers.event("save", step=self.state.global_step, path=file.name)
                    if self.hub is not None:
                        self.hub.upload(file, wait=name == self.config.output_name)
        if with_state:
            self.state.metrics = s.metrics.state_dict()
            state_dir = s.output_dir / state_dir_name(name)
            with reported_save(state_dir, s.output_dir):
                s.checkpointer.save(state_dir, self.state)
            self.state_saved_at = self.state.global_step
            self.trackers.event("state", step=self.state.global_step, path=state_dir.name)
            if self.hub is not None and self.config.save_state_to_huggingface:
                self.accelerator.wait_for_everyone()  # every process's files are in the folder
                if self.accelerator.is_main_process:
                    self.hub.upload(state_dir, wait=name == self.config.output_name)

    def validate(self) -> None:
        s, accelerator = self.s, self.accelerator
        # A schedule-free optimizer is measured at the weights it would save.
        with schedule_free_eval(s.optimizer), evaluating([s.unwrapped]):
            losses = validation_loss(
                s.data.validation, s.data.collate_fn, self.validation_losses, self.config.validation_timesteps,
                s.seed if self.config.validation_seed is None else self.config.validation_seed, accelerator.device,
                accelerator.process_index, accelerator.num_processes,
                lambda t: accelerator.reduce(t, reduction="sum") if accelerator.num_processes > 1 else t,
                limit=self.config.max_validation_steps)
        self.result.validation = losses
        self.validated_at = self.state.global_step
        self.trackers.log(validation_metrics(losses), step=self.state.global_step)
        logger.info("validation loss at step %d: %s", self.state.global_step,
                    ", ".join(f"t{t} {v:.4f}" for t, v in losses.items()))

    def validation_losses(self, batch: dict[str, Any], generator: torch.Generator,
                          timesteps: torch.Tensor) -> torch.Tensor:
        """One held-out image at every validation timestep, with the same latent sample and noise."""
        s, n = self.s, len(timesteps)
        batch = send_to_device(batch, self.accelerator.device)
        latents = batch_latents(batch, s.components.vae, generator, s.vae_dtype).to(s.weight_dtype)
        noise = s.objective.sample_noise(latents, generator)
        text = _expand(batch["text"], n)
        conditioning = _expand(batch_conditioning(s.components.family, batch, s.components.vae, s.vae_dtype), n)
        masked = {"mask": batch["loss_mask"].expand(n, *batch["loss_mask"].shape[1:])} if "loss_mask" in batch else {}
        with self.accelerator.autocast():
            return diffusion_loss(s.unwrapped, latents.expand(n, *latents.shape[1:]), text, conditioning,
                                  noise.expand(n, *noise.shape[1:]), timesteps, s.objective, **masked).float()

    def sample(self, epoch: int | None = None) -> None:
        s, config, device = self.s, self.config, self.accelerator.device
        components, unwrapped = s.components, s.unwrapped
        tokenize = components.family.tokenizer(components, config.max_token_length)

        def encode_text(text: str) -> Mapping[str, torch.Tensor]:
            tokens = {k: v[None] for k, v in send_to_device(tokenize(text), device).items()}
            return components.family.encode_text(components.text_encoders, tokens, config.clip_skip)

        # The components' encoders are the trained module's (LoRA attached in place) or, once cached, parked ones.
        models = SamplingModels(unwrapped.denoiser, components.text_encoders, components.vae,
                                components.tokenizers, components.noise_scheduler.config, components.family,
                                "v_prediction" if components.v_prediction else None, encode_text)
        with (schedule_free_eval(s.optimizer), on_device([*components.text_encoders, components.vae], device),
              reported_save(s.output_dir / "sample", s.output_dir)):
            samples = sample_images(
                s.prompts, models, s.output_dir / "sample", config.output_name, base_seed=s.seed,
                step=None if epoch is not None else self.state.global_step, epoch=epoch,
                default_sampler=config.sample_sampler, device=device,
                autocast_dtype=None if config.mixed_precision == "no" else s.weight_dtype,
                process_index=self.accelerator.process_index, num_processes=self.accelerator.num_processes)
        if samples:
            self.trackers.event("samples", step=self.state.global_step, epoch=epoch,
                                paths=[x.path.relative_to(s.output_dir).as_posix() for x in samples])
            self.trackers.log_images({f"sample/{x.prompt.index:02d}": np.asarray(x.image) for x in samples},
                                     step=self.state.global_step)

    def finish(self) -> RunResult:
        s, state, result = self.s, self.state, self.result
        if s.data.validation is not None and self.validated_at != state.global_step:
            self.validate()
        result.global_step = state.global_step
        result.model = s.unwrapped
        self.save_snapshot(self.config.output_name, self.config.save_state or self.config.save_state_on_train_end)
        if self.hub is not None:
            self.hub.wait()
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            files = [file for _, file in adapter_files(s.unwrapped.family,
                                                       s.output_dir / f"{self.config.output_name}.safetensors")]
            result.output_files = files
            result.output_file = files[0] if len(files) == 1 else None
            chart = loss_by_timestep_chart(s.metrics.timestep_loss.bins(), result.validation,
                                           s.objective.num_train_timesteps)
            chart_path = s.output_dir / f"{self.config.output_name}_loss_by_timestep.png"
            with reported_save(chart_path, s.output_dir):
                save_png(chart, chart_path)
            self.trackers.log_images({"loss/by_timestep": np.asarray(chart)}, step=state.global_step)
        return result


def sampling_due(config: Config, step: int, epoch_ended: bool, epoch: int) -> int | None | bool:
    """kohya's rule: with sample_every_n_epochs, sample at those epoch ends only (named by epoch); otherwise every
    sample_every_n_steps steps (named by step). Returns the epoch, None for a step round, or False."""
    if config.sample_every_n_epochs:
        return epoch if epoch_ended and epoch % config.sample_every_n_epochs == 0 else False
    if config.sample_every_n_steps and step % config.sample_every_n_steps == 0:
        return None
    return False


def _expand(tensors: Mapping[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: v.expand(n, *v.shape[1:]) for k, v in tensors.items()}
