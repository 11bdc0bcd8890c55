"""Levanter's `levanter.main.train_lm`, edited as docs/porting.md says, for bf16 or f16.

A user ports Levanter by editing their copy of ``train_lm.py``. This script makes
that edit on the installed Levanter's own source, so what runs is Levanter's
script plus exactly these lines (``--amp=f16``; ``--amp=bf16`` drops the first):

    import jaxamp
    optimizer = jaxamp.loss_scaling(config.optimizer.build(config.trainer.num_train_steps))
    loss_function = jaxamp.amp(loss_function, compute_dtype="f16", loss_scale=optimizer)

Usage (the other arguments are train_lm's own; ``--amp=f32`` runs it unedited;
``--scaler=2.0**24`` sets f16's initial loss scale, for an overflow test):

    python examples/levanter_train_lm.py --make_data=/tmp/lev   # corpus, tokenizer, tiny.yaml; no network
    python examples/levanter_train_lm.py --amp=f16 --config_path /tmp/lev/tiny.yaml [--show_diff]

The corpus is the docstrings of Python's standard library (about 0.6 MB), the
tokenizer a byte-level BPE of 512 tokens trained on it, the model a 2-layer
Llama (hidden 64, sequence 64): docs/porting.md's Levanter section quotes its runs.

Keep ``trainer.mp`` at float32 (its default): amp does the casting.
"""

from __future__ import annotations

import difflib
import inspect
import sys
import types

BUILD = "    optimizer = config.optimizer.build(config.trainer.num_train_steps)\n"
LOSS = "    loss_function = functools.partial(compute_next_token_loss, logsumexp_weight=config.z_loss_weight)\n"


def edited_source(amp: str, scaler: str | None = None) -> str:
    """train_lm's source with porting.md's lines for `amp` ("f32": unedited); `scaler`: f16's initial scale."""
    import levanter.main.train_lm as train_lm

    source = inspect.getsource(train_lm)
    if amp == "f32":
        return source
    for anchor in (BUILD, LOSS, "import levanter\n"):
        if source.count(anchor) != 1:
            raise RuntimeError(f"levanter.main.train_lm changed: {anchor.strip()!r} is not there once")
    source = source.replace("import levanter\n", "import jaxamp\nimport levanter\n")
    if amp == "f16":
        extra = "" if scaler is None else f", scaler={scaler}"
        wrapped = BUILD.replace("= config.optimizer.build(", "= jaxamp.loss_scaling(config.optimizer.build(")
        source = source.replace(BUILD, wrapped[:-1] + extra + ")\n")
        line = '    loss_function = jaxamp.amp(loss_function, compute_dtype="f16", loss_scale=optimizer)\n'
    elif amp == "bf16":
        line = '    loss_function = jaxamp.amp(loss_function, compute_dtype="bf16")\n'
    else:
        raise ValueError(f"--amp must be f32, bf16 or f16, got {amp!r}")
    return source.replace(LOSS, LOSS + line)


def bool_mask_reduce():
    """haliax's loss reduction with its mask cast to bool, where this JAX refuses a float mask; else None.

    Levanter 1.2.dev1644 with JAX >= 0.10 (which jaxamp needs): its loss averages
    with a float 0/1 mask (``hax.mean(loss, where=mask)``), which JAX 0.10 refuses
    ("where must be None or a boolean array") even in float32. A bool mask holds
    the same elements, so the mean is the same. A Levanter/JAX matter, not a jaxamp one.
    """
    import haliax.nn.loss as hax_loss
    import jax.numpy as jnp

    try:
        jnp.mean(jnp.ones(2), where=jnp.ones(2))
        return None  # this JAX still takes a float mask
    except ValueError:
        pass
    reduce = hax_loss.maybe_reduce_loss

    def maybe_reduce_loss(arr, reduction, reduction_axis, where):
        if where is not None and where.dtype != jnp.bool_:
            where = where != 0
        return reduce(arr, reduction, reduction_axis, where)

    return maybe_reduce_loss


def _bool_loss_masks() -> None:
    """Put `bool_mask_reduce`'s loss reduction into haliax, where this JAX needs it."""
    import haliax.nn.loss as hax_loss

    replacement = bool_mask_reduce()
    if replacement is not None:
        hax_loss.maybe_reduce_loss = replacement


TINY_YAML = """\
data:
  tokenizer: {dir}/tokenizer
  cache_dir: {dir}/cache
  train_urls: ["{dir}/data/train.jsonl"]
model:
  type: llama
  tokenizer: {dir}/tokenizer
  seq_len: 64
  hidden_dim: 64
  intermediate_dim: 128
  num_layers: 2
  num_heads: 4
  num_kv_heads: 4
trainer:
  seed: 0
  num_train_steps: 40
  train_batch_size: 8
  require_accelerator: false
  log_dir: {dir}/logs
  tracker:
    type: json_logger
  checkpointer:
    base_path: {dir}/ckpt
    save_interval: 5s
optimizer:
  learning_rate: 3e-3
  weight_decay: 0.0
  warmup: 0.0
"""


def make_data(out: str) -> None:
    """Write a local corpus, tokenizer and config under `out` (Levanter cannot download here).

    Run before Levanter is imported: the corpus depends on which modules import.
    """
    import importlib
    import json
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts: list[str] = []
    skip = {"antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle"}
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in skip:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - platform-specific modules
            continue
        for obj in [module] + [getattr(module, n, None) for n in sorted(dir(module)) if not n.startswith("_")]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200 and doc not in texts:
                texts.append(doc)
    os.makedirs(f"{out}/data", exist_ok=True)
    with open(f"{out}/data/train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[max(1, len(texts) // 20) :])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    tokenizer.train_from_iterator(texts, trainer)
    eos = "<|endoftext|>"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=eos, eos_token=eos).save_pretrained(
        f"{out}/tokenizer"
    )
    with open(f"{out}/tiny.yaml", "w") as f:
        f.write(TINY_YAML.format(dir=os.path.abspath(out)))
    print(f"{len(texts)} documents; config {out}/tiny.yaml")


def main() -> None:
    amp, scaler, show_diff, argv = "f32", None, False, [sys.argv[0]]
    for arg in sys.argv[1:]:
        if arg.startswith("--amp="):
            amp = arg.split("=", 1)[1]
        elif arg.startswith("--scaler="):
            scaler = arg.split("=", 1)[1]
        elif arg.startswith("--make_data="):
            return make_data(arg.split("=", 1)[1])
        elif arg == "--show_diff":
            show_diff = True
        else:
            argv.append(arg)
    sys.argv = argv
    import levanter
    import levanter.main.train_lm as train_lm

    _bool_loss_masks()
    source = edited_source(amp, scaler)
    if show_diff:
        original = inspect.getsource(train_lm).splitlines(keepends=True)
        sys.stdout.writelines(
            difflib.unified_diff(original, source.splitlines(keepends=True), "train_lm.py", "train_lm.py")
        )
    module = types.ModuleType("train_lm_amp")
    module.__file__ = train_lm.__file__
    sys.modules[module.__name__] = module  # dataclasses and draccus look the config class up here
    exec(compile(source, train_lm.__file__, "exec", dont_inherit=True), module.__dict__)
    levanter.config.main(module.main)()


if __name__ == "__main__":
    main()
