"""From `cosyvoice3.yaml` to the flow and HiFT configs, and back (for the tiny checkpoint)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from intone.errors import ModelLoadError
from intone.models.cosyvoice3.config import section
from intone.models.cosyvoice3.dit import DiTConfig
from intone.models.cosyvoice3.flow import CosyFlow, FlowConfig
from intone.models.cosyvoice3.hift import CausalHiFT, HiFTConfig
from intone.models.cosyvoice3.noise import FlowSizes


def flow_config(cfg: dict, path: str | Path = "cosyvoice3.yaml") -> FlowConfig:
    flow = section(cfg, "flow", path)
    try:
        est = flow["decoder"]["estimator"]
        cfm = flow["decoder"].get("cfm_params", {}).get("content", {})
        dit = DiTConfig(**{k: est[k] for k in ("dim", "depth", "heads", "dim_head", "ff_mult", "mel_dim", "mu_dim",
                                                "spk_dim", "out_channels", "static_chunk_size") if k in est})
        return FlowConfig(
            vocab_size=flow["vocab_size"], input_size=flow["input_size"], output_size=flow["output_size"],
            spk_embed_dim=flow["spk_embed_dim"], pre_lookahead_len=flow["pre_lookahead_len"],
            pre_lookahead_channels=flow["pre_lookahead_layer"]["channels"],
            token_mel_ratio=flow["token_mel_ratio"],
            inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)), dit=dit,
        )
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: flow section lacks {e}") from None


def hift_config(cfg: dict, path: str | Path = "cosyvoice3.yaml") -> HiFTConfig:
    h = section(cfg, "hift", path)
    try:
        f0 = h["f0_predictor"]
        tuples = lambda v: tuple(tuple(x) if isinstance(x, list) else x for x in v)  # noqa: E731
        return HiFTConfig(
            in_channels=h["in_channels"], base_channels=h["base_channels"], nb_harmonics=h["nb_harmonics"],
            sampling_rate=h["sampling_rate"], nsf_alpha=h["nsf_alpha"], nsf_sigma=h["nsf_sigma"],
            nsf_voiced_threshold=h["nsf_voiced_threshold"], upsample_rates=tuple(h["upsample_rates"]),
            upsample_kernel_sizes=tuple(h["upsample_kernel_sizes"]), n_fft=h["istft_params"]["n_fft"],
            hop_len=h["istft_params"]["hop_len"], resblock_kernel_sizes=tuple(h["resblock_kernel_sizes"]),
            resblock_dilation_sizes=tuples(h["resblock_dilation_sizes"]),
            source_resblock_kernel_sizes=tuple(h["source_resblock_kernel_sizes"]),
            source_resblock_dilation_sizes=tuples(h["source_resblock_dilation_sizes"]),
            lrelu_slope=h["lrelu_slope"], audio_limit=h["audio_limit"], conv_pre_look_right=h["conv_pre_look_right"],
            f0_cond_channels=f0["cond_channels"],
        )
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: hift section lacks {e}") from None


def flow_sizes(cfg: FlowConfig) -> FlowSizes:
    return FlowSizes(cfg.vocab_size, cfg.input_size, cfg.spk_embed_dim, cfg.output_size)


# ---- the tiny checkpoint ----------------------------------------------------------------------

def tiny_configs(flow: dict, hift: dict) -> tuple[FlowConfig, HiFTConfig]:
    dit = DiTConfig(dim=flow["dim"], depth=flow["depth"], heads=flow["heads"], dim_head=flow["dim_head"],
                    ff_mult=flow["ff_mult"])
    return (FlowConfig(pre_lookahead_channels=flow["lookahead_channels"], dit=dit),
            HiFTConfig(base_channels=hift["base_channels"], f0_cond_channels=hift["f0_channels"]))


def tiny_codec(flow: dict, hift: dict) -> tuple[dict, dict]:
    """Random flow.pt and hift.pt state dicts; hift in the `parametrizations` weight-norm form."""
    fcfg, hcfg = tiny_configs(flow, hift)
    f = CosyFlow(fcfg)
    h = CausalHiFT(hcfg)
    with torch.no_grad():
        for module in (f, h):
            for name, p in module.named_parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
                elif "alpha" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
    # Stored in float32, as the released files are (the F0 predictor lives in float64 in CausalHiFT).
    hift_state = {k: v.float() for k, v in unfold_weight_norm(h.state_dict(), weight_normed(h)).items()}
    return dict(f.state_dict()), hift_state


_WEIGHT_NORMED = re.compile(r"(conv_pre|conv_post|ups\.\d+|(source_)?resblocks\.\d+\.convs[12]\.\d+"
                            r"|f0_predictor\.condnet\.\d+)\.weight")


def weight_normed(h: CausalHiFT) -> set[str]:
    """Names of the HiFT weights the official generator keeps under weight norm (77 + the F0
    predictor's 5 at full size; the source downsamplers and linear layers have none)."""
    return {k for k in h.state_dict() if _WEIGHT_NORMED.fullmatch(k)}


def unfold_weight_norm(state: dict, names: set[str]) -> dict:
    """w -> (original0 = ||w|| over all but dim 0, original1 = w), as torch's parametrization stores it."""
    out = {}
    for key, value in state.items():
        stem = key[: -len(".weight")] if key.endswith(".weight") else None
        if stem is not None and key in names:
            out[f"{stem}.parametrizations.weight.original0"] = torch.linalg.vector_norm(
                value, dim=tuple(range(1, value.dim())), keepdim=True)
            out[f"{stem}.parametrizations.weight.original1"] = value
        else:
            out[key] = value
    return out


def yaml_text(llm_size: int, flow: dict, hift: dict) -> str:
    """cosyvoice3.yaml in the official HyperPyYAML structure (model sections only)."""
    fcfg, hcfg = tiny_configs(flow, hift)
    d = fcfg.dit
    return f"""# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

# fixed params
sample_rate: {hcfg.sampling_rate}
llm_input_size: {llm_size}
llm_output_size: {llm_size}
spk_embed_dim: {fcfg.spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: {fcfg.token_mel_ratio}

# stream related params
chunk_size: 25 # streaming inference chunk size, in token
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: {fcfg.input_size}
    output_size: {fcfg.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {fcfg.vocab_size}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {fcfg.pre_lookahead_len}
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: {fcfg.input_size}
        channels: {fcfg.pre_lookahead_channels}
        pre_lookahead_len: {fcfg.pre_lookahead_len}
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: {fcfg.output_size}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: {fcfg.inference_cfg_rate}
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {d.dim}
            depth: {d.depth}
            heads: {d.heads}
            dim_head: {d.dim_head}
            ff_mult: {d.ff_mult}
            mel_dim: {d.mel_dim}
            mu_dim: {d.mu_dim}
            spk_dim: {d.spk_dim}
            out_channels: {d.out_channels}
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: {hcfg.in_channels}
    base_channels: {hcfg.base_channels}
    nb_harmonics: {hcfg.nb_harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {hcfg.nsf_alpha}
    nsf_sigma: {hcfg.nsf_sigma}
    nsf_voiced_threshold: {int(hcfg.nsf_voiced_threshold)}
    upsample_rates: {list(hcfg.upsample_rates)}
    upsample_kernel_sizes: {list(hcfg.upsample_kernel_sizes)}
    istft_params:
        n_fft: {hcfg.n_fft}
        hop_len: {hcfg.hop_len}
    resblock_kernel_sizes: {list(hcfg.resblock_kernel_sizes)}
    resblock_dilation_sizes: {[list(x) for x in hcfg.resblock_dilation_sizes]}
    source_resblock_kernel_sizes: {list(hcfg.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: {[list(x) for x in hcfg.source_resblock_dilation_sizes]}
    lrelu_slope: {hcfg.lrelu_slope}
    audio_limit: {hcfg.audio_limit}
    conv_pre_look_right: {hcfg.conv_pre_look_right}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: {hcfg.in_channels}
        cond_channels: {hcfg.f0_cond_channels}
"""
