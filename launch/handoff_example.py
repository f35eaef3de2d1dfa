"""Training-to-serving handoff, end to end, on CPU (see docs/handoff.md).

    python launch/handoff_example.py init DIR/init                       # "pretrained" weights
    torchrun --nproc-per-node 4 launch/handoff_example.py train \\
        --init DIR/init --out DIR/trained --steps 5                        # TP=4 training, save
    torchrun --nproc-per-node 2 launch/handoff_example.py serve \\
        --ckpt DIR/trained --expect DIR/trained/eval_logits.pt             # TP=2 serving

The model is a tiny llama-style decoder (no rotary embedding, to keep it short) whose
parameter names follow the HF llama naming, so coordloader's ``llama`` preset shards it:
q/k/v by heads, o_proj and down_proj by input columns (rowwise), gate/up colwise,
embed_tokens and lm_head by vocabulary rows, norms replicated. Tensor parallelism is the
Megatron pattern: an all-reduce after every rowwise matmul in the forward pass, an
all-reduce of the input gradient before every colwise matmul in the backward pass.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from coordloader.handoff.save import save
from coordloader.layout import Layout
from coordloader.loader import load, load_detailed

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
    "vocab_size": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
SEQ, BATCH = 16, 8


# --------------------------------------------------------------------- TP plumbing

class _AllReduceFwd(torch.autograd.Function):
    """Sum of the ranks' partial outputs (after a rowwise matmul); identity backward."""
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _AllReduceBwd(torch.autograd.Function):
    """Identity forward (before a colwise matmul); sums the input gradients backward."""
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class _GatherLast(torch.autograd.Function):
    """Concatenate vocab-sharded logits; backward keeps this rank's columns."""
    @staticmethod
    def forward(ctx, x):
        ctx.rank, ctx.n = dist.get_rank(), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous()


def reduce_fwd(x, tp):
    return _AllReduceFwd.apply(x) if tp > 1 else x


def reduce_bwd(x, tp):
    return _AllReduceBwd.apply(x) if tp > 1 else x


def gather_last(x, tp):
    return _GatherLast.apply(x) if tp > 1 else x


# --------------------------------------------------------------------- the model

def rms_norm(x, w, eps=CONFIG["rms_norm_eps"]):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def forward(p: dict, ids: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """Full logits [B, T, V] from this rank's parameter shards ``p`` (HF llama names)."""
    c = CONFIG
    hd = c["head_dim"]
    emb = p["model.embed_tokens.weight"]
    lo = tp_rank * emb.shape[0]
    local = (ids >= lo) & (ids < lo + emb.shape[0])
    x = F.embedding((ids - lo).clamp(0, emb.shape[0] - 1), emb) * local.unsqueeze(-1)
    x = reduce_fwd(x, tp)
    B, T = ids.shape
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        h = reduce_bwd(rms_norm(x, p[pre + "input_layernorm.weight"]), tp)
        q, k, v = (h @ p[pre + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))   # local heads
        att = (q @ k.transpose(-1, -2)) / hd ** 0.5
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(B, T, -1)
        x = x + reduce_fwd(o @ p[pre + "self_attn.o_proj.weight"].T, tp)
        h = reduce_bwd(rms_norm(x, p[pre + "post_attention_layernorm.weight"]), tp)
        m = F.silu(h @ p[pre + "mlp.gate_proj.weight"].T) * (h @ p[pre + "mlp.up_proj.weight"].T)
        x = x + reduce_fwd(m @ p[pre + "mlp.down_proj.weight"].T, tp)
    h = reduce_bwd(rms_norm(x, p["model.norm.weight"]), tp)
    return gather_last(h @ p["lm_head.weight"].T, tp)


def batch(step: int):
    """Toy task: next token of an arithmetic progression mod V (learnable in a few steps)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CONFIG["vocab_size"], (BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % CONFIG["vocab_size"]
    return seq[:, :-1], seq[:, 1:]


# --------------------------------------------------------------------- commands

def cmd_init(a) -> None:
    """Write a plain HF checkpoint of freshly initialised weights ("the pretrained model")."""
    from safetensors.torch import save_file
    c = CONFIG
    H, I, V, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    sd = {"model.embed_tokens.weight": torch.randn(V, H, generator=g), "lm_head.weight": w(V, H),
          "model.norm.weight": torch.ones(H)}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        sd.update({pre + "input_layernorm.weight": torch.ones(H),
                   pre + "post_attention_layernorm.weight": torch.ones(H),
                   pre + "self_attn.q_proj.weight": w(c["num_attention_heads"] * hd, H),
                   pre + "self_attn.k_proj.weight": w(c["num_key_value_heads"] * hd, H),
                   pre + "self_attn.v_proj.weight": w(c["num_key_value_heads"] * hd, H),
                   pre + "self_attn.o_proj.weight": w(H, c["num_attention_heads"] * hd),
                   pre + "mlp.gate_proj.weight": w(I, H), pre + "mlp.up_proj.weight": w(I, H),
                   pre + "mlp.down_proj.weight": w(H, I)})
    os.makedirs(a.dir, exist_ok=True)
    save_file(sd, os.path.join(a.dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a.dir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    print(f"init: wrote {len(sd)} tensors to {a.dir}")


def _init_dist():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def cmd_train(a) -> None:
    rank, world = _init_dist()
    layout = Layout(tp=world)
    # Start from the pretrained checkpoint: each rank gets exactly its TP=4 shards.
    res = load_detailed(a.init, layout, verify="digest" if a.verify_digest else "shapes")
    params = {n: t.clone().requires_grad_(True) for n, t in res.tensors.items()}
    opt = torch.optim.Adam(params.values(), lr=a.lr)
    for step in range(a.steps):
        ids, tgt = batch(step)
        loss = F.cross_entropy(forward(params, ids, world, rank).reshape(-1, CONFIG["vocab_size"]),
                               tgt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"train: step {step} loss {loss.item():.4f}", flush=True)
    state = {n: p.detach() for n, p in params.items()}
    t0 = time.perf_counter()
    # The handoff: every rank writes its primary shards; rank 0 publishes the index last.
    r = save(a.out, state, res.plan, config=os.path.join(a.init, "config.json"), overwrite=True)
    dt = time.perf_counter() - t0
    with torch.no_grad():
        logits = forward(state, batch(10_000)[0], world, rank)
    if rank == 0:
        torch.save(logits, os.path.join(a.out, "eval_logits.pt"))
        print(f"train: saved TP={world} shards to {a.out} in {dt:.2f} s "
              f"(rank 0 wrote {r.bytes_written} bytes in {len(r.files)} file(s))", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def cmd_serve(a) -> None:
    rank, world = _init_dist()
    ids = batch(10_000)[0]
    # Serving side: a different layout, resharded by the planner from the saved pieces.
    tensors = load(a.ckpt, Layout(tp=world), verify="digest")
    with torch.no_grad():
        logits = forward(tensors, ids, world, rank)
    ok = True
    solo = dist.new_group([0])  # every rank takes part in creating a group
    if rank == 0:
        want = torch.load(a.expect)
        err = (logits - want).abs().max().item()
        ok = torch.allclose(logits, want, rtol=1e-4, atol=1e-5)
        print(f"serve: TP={world} logits vs training-side TP=4 logits: max abs diff {err:.3g} "
              f"-> {'OK' if ok else 'MISMATCH'}", flush=True)
        # and one process holding everything (world 1), as a consolidated load would
        whole = load(a.ckpt, Layout(), group=solo)
        with torch.no_grad():
            l1 = forward(whole, ids, 1, 0)
        err1 = (l1 - want).abs().max().item()
        ok1 = torch.allclose(l1, want, rtol=1e-4, atol=1e-5)
        print(f"serve: TP=1 logits vs training-side logits: max abs diff {err1:.3g} "
              f"-> {'OK' if ok1 else 'MISMATCH'}", flush=True)
        ok = ok and ok1
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    dist.destroy_process_group()
    if flag.item():
        sys.exit(1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("init")
    p.add_argument("dir")
    p = sub.add_parser("train")
    p.add_argument("--init", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--verify-digest", action="store_true")
    p = sub.add_parser("serve")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--expect", required=True)
    a = ap.parse_args(argv)
    {"init": cmd_init, "train": cmd_train, "serve": cmd_serve}[a.cmd](a)


if __name__ == "__main__":
    main()
