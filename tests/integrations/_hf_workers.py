"""Rank-side code of the Hugging Face AdaptiveTrainer tests (in the spawned gloo processes;
the process group exists, so accelerate joins it)."""
from __future__ import annotations

import os
import warnings

import torch


def _env(rank, world):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29597")


class DS(torch.utils.data.Dataset):
    def __init__(self, n=96, T=8):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 32, (n, T), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def args(folder, **kw):
    import transformers

    base = dict(output_dir=folder, per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3,
                lr_scheduler_type="constant", logging_steps=1, report_to="none", use_cpu=True,
                save_strategy="steps", save_steps=3, dataloader_num_workers=0, seed=0,
                disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def trainer(folder, world=1, **kw):
    from gns_kernels.integrations.huggingface import AdaptiveTrainer

    return AdaptiveTrainer(model(), args(folder, **kw), train_dataset=DS(),
                           initial_batch_size=8 * world, max_batch_size=16 * world,
                           coordinator=dict(every=2, theta=0.3))


def params(t):
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}


def _count_examples(t, counts):
    """Count the examples of every training forward (a pre-hook on the model)."""
    def hook(module, args, kwargs):
        if module.training:
            counts.append(int(kwargs["input_ids"].shape[0]))
    return t.model.register_forward_pre_hook(hook, with_kwargs=True)


def fit(rank, world, folder, resume=True):
    """6 steps on `world` processes (a checkpoint at step 3), then a fresh trainer resumed
    from checkpoint-3 to step 6: both runs' steps 3-5 and final weights, train()'s
    metrics and this rank's examples per train() call (counted at the model's forward)."""
    if world > 1:
        _env(rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer(folder, world)
        seen = []
        _count_examples(t, seen)
        metrics = t.train().metrics
        out = {"history": t.gns_history, "params": params(t), "ddp": type(t.model_wrapped).__name__,
               "logs": [h for h in t.state.log_history if "gns/step" in h],
               "metrics": metrics, "examples": sum(seen)}
        if resume:
            t2 = trainer(os.path.join(folder, "again"), world)
            t2.args.output_dir = folder
            seen2 = []
            _count_examples(t2, seen2)
            metrics2 = t2.train(resume_from_checkpoint=os.path.join(folder, "checkpoint-3")).metrics
            out.update(resumed=t2.gns_history, resumed_params=params(t2), resumed_metrics=metrics2,
                       resumed_examples=sum(seen2))
    # the package's warnings (the documented use raises none; transformers' own are left out)
    out["warnings"] = [str(w.message) for w in caught if any(
        k in str(w.message) for k in ("AdaptiveTrainer", "AdaptiveBatching", "MicroBatchGNS",
                                      "GNSHookState", "gns_kernels", "coord."))]
    return out
