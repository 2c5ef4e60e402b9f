"""Random IP-Adapters for tiny diffusers UNets, in the original layout, and a folder holding one as diffusers'
``load_ip_adapter`` reads it: ``ip-adapter.safetensors`` (flat ``image_proj.*`` / ``ip_adapter.*`` names) beside an
``image_encoder`` (a tiny random ``CLIPVisionModelWithProjection``)."""

import torch

EMBED = 12  # the CLIP image embedding's width


def ip_adapter_state(unet, seed: int, embed: int = EMBED) -> dict:
    """A random plain IP-Adapter for diffusers' ``unet`` in the original layout (``image_proj`` / ``ip_adapter``)."""
    gen = torch.Generator().manual_seed(seed)
    width = unet.config.cross_attention_dim
    names = [n for n in unet.attn_processors if n.endswith("attn2.processor")]
    ip = {}
    for i, name in enumerate(names):
        block = name.split(".")[0]
        if block == "mid_block":
            hidden = unet.config.block_out_channels[-1]
        else:
            index = int(name.split(".")[1])
            channels = unet.config.block_out_channels
            hidden = (channels if block == "down_blocks" else channels[::-1])[index]
        for kv in "kv":
            ip[f"{2 * i + 1}.to_{kv}_ip.weight"] = torch.randn(hidden, width, generator=gen) / width ** 0.5
    proj = {"proj.weight": torch.randn(4 * width, embed, generator=gen) / embed ** 0.5,
            "proj.bias": torch.randn(4 * width, generator=gen) * 0.1,
            "norm.weight": 1 + torch.randn(width, generator=gen) * 0.1,
            "norm.bias": torch.randn(width, generator=gen) * 0.1}
    return {"image_proj": proj, "ip_adapter": ip}


def as_numpy(state: dict) -> dict:
    return {part: {k: v.numpy() for k, v in tensors.items()} for part, tensors in state.items()}


def plus_image_proj(width: int, seed: int, *, embed: int = 16, hidden: int = 20, heads: int = 2, queries: int = 6,
                    depth: int = 4) -> dict:
    """A random IP-Adapter Plus ``image_proj`` (the original Resampler layout) making ``queries`` tokens of
    ``width`` from image-encoder hidden states of ``embed`` (``depth`` 4: diffusers builds 4 blocks whatever the
    file says)."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    def norm(prefix):
        return {f"{prefix}.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
                f"{prefix}.bias": 0.1 * torch.randn(hidden, generator=gen)}

    inner = heads * 64
    state = {"latents": torch.randn(1, queries, hidden, generator=gen) / hidden ** 0.5,
             "proj_in.weight": w(hidden, embed), "proj_in.bias": 0.1 * torch.randn(hidden, generator=gen),
             "proj_out.weight": w(width, hidden), "proj_out.bias": 0.1 * torch.randn(width, generator=gen),
             "norm_out.weight": 1 + 0.1 * torch.randn(width, generator=gen),
             "norm_out.bias": 0.1 * torch.randn(width, generator=gen)}
    for i in range(depth):
        state.update({**norm(f"layers.{i}.0.norm1"), **norm(f"layers.{i}.0.norm2"), **norm(f"layers.{i}.1.0"),
                      f"layers.{i}.0.to_q.weight": w(inner, hidden), f"layers.{i}.0.to_kv.weight": w(2 * inner, hidden),
                      f"layers.{i}.0.to_out.weight": w(hidden, inner), f"layers.{i}.1.1.weight": w(4 * hidden, hidden),
                      f"layers.{i}.1.3.weight": w(hidden, 4 * hidden)})
    return state


def save_ip_adapter(folder, unet, seed: int = 2) -> dict:
    """Write a random IP-Adapter for diffusers' ``unet`` and a tiny CLIP image encoder into ``folder``; return the
    adapter's state (the original layout, torch tensors)."""
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    from ._util import randomize_torch

    state = ip_adapter_state(unet, seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"{part}.{k}": v.contiguous() for part, tensors in state.items() for k, v in tensors.items()},
              str(folder / "ip-adapter.safetensors"))
    torch.manual_seed(seed)
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        patch_size=8, projection_dim=EMBED)).eval()
    randomize_torch(encoder, seed)
    encoder.save_pretrained(folder / "image_encoder", safe_serialization=True)
    return state
