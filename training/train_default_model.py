"""Train the embedded default model (model/default_model/): a ~7M-parameter Qwen3 (transformers' own
``Qwen3ForCausalLM``, so nanoserve's loader and the HF oracle both apply) on the Python standard library's sources.

    python -m training.train_default_model OUT_DIR [--seed 0] [--steps 1000] [--compile]

It trains the tokenizer (training/train_tokenizer.py), tokenizes the training files (training/corpus.py: the
held-out ~2% of files are never seen), trains with AdamW, bf16 autocast and a cosine schedule on windows of
``--seq-len`` tokens, and writes a bf16 checkpoint (config.json, generation_config.json, model.safetensors, the
tokenizer) plus training_record.json (Python version whose stdlib it read, steps, tokens, losses, time, device).
Given its seed the data order and the initial weights are fixed; deterministic algorithms are asked of torch.
``--max-seconds`` shortens the schedule once, after the first steps, if the run would not fit (the record says
how many steps ran: pass them as ``--steps`` to repeat it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np

from training.corpus import EOT, IM_END, documents, python_version, split, stdlib_files, stdlib_root
from training.train_tokenizer import train_tokenizer


def shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary, special tokens included")
    p.add_argument("--hidden-size", type=int, default=256, help="model width")
    p.add_argument("--intermediate-size", type=int, default=768, help="MLP width")
    p.add_argument("--layers", type=int, default=6, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=64, help="per-head width")
    p.add_argument("--seq-len", type=int, default=2048, help="training window in tokens (also max_position_embeddings)")


def make_config(args, tokenizer):
    from transformers import Qwen3Config

    eot, im_end = tokenizer.convert_tokens_to_ids([EOT, IM_END])
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10_000.0, "rope_type": "default"},
        bos_token_id=eot,
        eos_token_id=[eot, im_end],  # a file ends with <|endoftext|>, a chat reply with <|im_end|>
        pad_token_id=eot,
        initializer_range=0.02,
    )


def token_stream(tokenizer, docs: list[str], seed: int) -> np.ndarray:
    """Every document's ids, each followed by <|endoftext|>, in an order fixed by ``seed``."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    encoded = tokenizer.backend_tokenizer.encode_batch([docs[i] for i in order], add_special_tokens=False)
    parts = [np.asarray(e.ids + [eot], dtype=np.int32) for e in encoded]
    return np.concatenate(parts)


def windows(stream: np.ndarray, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """One epoch: the stream cut into ``seq_len`` windows from a random offset, in a random order."""
    start = int(rng.integers(seq_len))
    n = (len(stream) - start) // seq_len
    w = stream[start : start + n * seq_len].reshape(n, seq_len)
    return w[rng.permutation(n)]


def save_tokenizer(tokenizer, out: Path) -> None:
    """tokenizer.json and one tokenizer_config.json that transformers 4.x loads too (its class name, the chat
    template inside rather than in a chat_template.jinja of 5.x's)."""
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=tokenizer.chat_template)
    for key in ("backend", "is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=1) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))  # cosine down to 10% of peak


def held_out_loss(model, held: np.ndarray, seq_len: int, device, max_windows: int = 64) -> float:
    import torch

    n = min(max_windows, len(held) // seq_len)
    x = torch.from_numpy(held[: n * seq_len].reshape(n, seq_len).astype(np.int64)).to(device)
    losses = []
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for i in range(0, n, 8):
            losses.append(model(input_ids=x[i : i + 8], labels=x[i : i + 8]).loss.float().item())
    model.train()
    return float(np.mean(losses))


def main(argv: list[str] | None = None) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import GenerationConfig, Qwen3ForCausalLM

    # not cuDNN's attention, whose backward is non-deterministic (the weights in model/default_model/ were trained
    # before this line, with it): flash attention's backward is deterministic under use_deterministic_algorithms
    ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("out_dir", type=Path, help="where the checkpoint and training_record.json are written")
    p.add_argument("--seed", type=int, default=0, help="data order, window offsets and initial weights")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="windows per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--max-seconds", type=float, default=0, help="shorten the schedule to fit (0: never)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out loss readings")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--max-files", type=int, default=0, help="train on the first N training files only (0: all)")
    p.add_argument("--stdlib", type=Path, help="the standard library's directory (default: this Python's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    shape_args(p)
    args = p.parse_args(argv)
    t_start = time.time()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    train_files, held_files = split(stdlib_files(stdlib_root(args.stdlib)))
    train_files = train_files[: args.max_files or None]  # a quick smoke run; the record says how many
    tokenizer = train_tokenizer([text for _, text in train_files], args.vocab_size)
    t_tok = time.time() - t_start
    stream = token_stream(tokenizer, documents(train_files), args.seed)
    held = token_stream(tokenizer, documents(held_files, with_chat=False), args.seed)
    print(f"python {python_version(args.stdlib)} stdlib: {len(train_files)} training files ({len(stream):,} tokens), "
          f"{len(held_files)} held out ({len(held):,} tokens); tokenizer {t_tok:.0f} s", flush=True)  # fmt: skip

    config = make_config(args, tokenizer)
    model = Qwen3ForCausalLM(config).to(device)  # the config's initializer_range: HF's own initialisation
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params:,} parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    fwd = torch.compile(model) if args.compile else model

    rng = np.random.default_rng(args.seed)
    epoch, batches, total = 0, iter(()), args.steps
    losses, evals = [], []
    t_train = time.time()
    step = 0
    while step < total:
        batch = next(batches, None)
        if batch is None:
            w = windows(stream, args.seq_len, rng)
            epoch += 1
            batches = (w[i : i + args.batch] for i in range(0, len(w) - args.batch + 1, args.batch))
            continue
        x = torch.from_numpy(batch.astype(np.int64)).to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.lr, args.warmup)
        with torch.autocast(device.type, dtype=torch.bfloat16), sdpa_kernel(ATTENTION):
            loss = fwd(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == 20 and args.max_seconds:  # once: a fixed schedule that fits the budget
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_train) / step
            fits = int((args.max_seconds - (time.time() - t_start)) / per_step)
            if fits < total:
                total = max(step + 1, fits)
                print(f"schedule shortened to {total} steps to fit --max-seconds", flush=True)
        if step % 10 == 0 or step == total or step % args.eval_every == 0:
            losses.append((step, loss.item()))
        if step % args.eval_every == 0 or step == total:
            h = held_out_loss(model, held, args.seq_len, device)
            evals.append((step, h))
            tok_s = step * args.batch * args.seq_len / (time.time() - t_train)
            print(f"step {step}/{total} epoch {epoch} lr {opt.param_groups[0]['lr']:.2e} loss {losses[-1][1]:.3f} "
                  f"held-out {h:.3f} (ppl {math.exp(h):.2f}) {tok_s / 1e3:.0f}k tok/s", flush=True)  # fmt: skip
    train_s = time.time() - t_train

    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out)
    ids = dict(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    GenerationConfig(**ids).save_pretrained(out)
    save_tokenizer(tokenizer, out)
    record = {
        "python": python_version(args.stdlib),
        "stdlib": str(stdlib_root(args.stdlib)),
        "train_files": len(train_files),
        "held_out_files": len(held_files),
        "train_tokens": int(len(stream)),
        "held_out_tokens": int(len(held)),
        "parameters": n_params,
        "seed": args.seed,
        "steps": total,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_seen": total * args.batch * args.seq_len,
        "epochs": round(total * args.batch * args.seq_len / len(stream), 2),
        "lr": args.lr,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "final_train_loss": losses[-1][1],
        "held_out_loss_during_training": evals,
        "train_loss": losses,
    }
    (out / "training_record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "train_loss"}))


if __name__ == "__main__":
    main()
