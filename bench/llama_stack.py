"""The Llama-shaped stack of bench/llama_stack.h in PyTorch: same parameter names, shapes,
initialisation and data, so that PyTorch's fully_shard and mdist's train the same thing."""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # byte-level
DIM = 512
LAYERS = 8
HEADS = 8
INTERMEDIATE = 1536
NORM_EPS = 1e-5
ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, NORM_EPS)


def rotary_tables(seq_len, head_dim):
    """cos and sin [seq_len, head_dim] of the rotate-half formulation."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / float(head_dim)
    inv_freq = torch.pow(ROPE_THETA, exponents).reciprocal()
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x):
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, cos, sin):
        batch, time, _ = x.shape
        split = lambda t: t.view(batch, time, HEADS, DIM // HEADS).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, time, DIM))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(DIM, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, DIM, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(DIM)
        self.self_attn = Attention()
        self.post_attention_layernorm = RMSNorm(DIM)
        self.mlp = Mlp()

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        """Token ids [batch, time] -> logits [batch, time, vocab]."""
        cos, sin = rotary_tables(ids.size(1), DIM // HEADS)
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


@torch.no_grad()
def init_weights(model):
    """Deterministic and identical to the C++ side (same torch CPU generator): parameter i in
    name order is drawn after manual_seed(1000 + i); norm weights are ones."""
    for i, (name, param) in enumerate(sorted(model.named_parameters())):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            torch.manual_seed(1000 + i)
            param.normal_(0.0, 0.02)


def batch_tokens(step, first_seq, count, seq_len):
    """Sequences [first_seq, first_seq + count) of the global batch of `step`, as (inputs,
    targets) [count, seq_len]. Each sequence is a Fibonacci stream mod 256 (learnable from
    the two previous tokens) started from two bytes of (step, sequence): no RNG involved."""
    rows = []
    for seq in range(first_seq, first_seq + count):
        a, b = (step * 31 + seq * 17) % 256, (step * 7 + seq * 13 + 1) % 256
        row = [a, b]
        while len(row) < seq_len + 1:
            row.append((row[-1] + row[-2]) % 256)
        rows.append(row)
    tokens = torch.tensor(rows, dtype=torch.int64)
    return tokens[:, :-1], tokens[:, 1:]
