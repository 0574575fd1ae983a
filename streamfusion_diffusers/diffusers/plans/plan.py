"""`ModelPlan`: what one plan file declares (its own module, so plan files and the registry import it alike)."""
from __future__ import annotations

from dataclasses import dataclass, field

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelModelPlan, ContextParallelOutput


@dataclass(frozen=True)
class AfterText(ContextParallelInput):
    """Rows [text ; image] of which only the image rows are cut: the text (kept whole, `ModelPlan.text_whole`)
    stays in front on every rank (a rotary table or position ids built for the model's concatenated sequence)."""


@dataclass(frozen=True)
class KeptText(ContextParallelInput):
    """A text mask [B, T] whose trailing columns no batch row keeps are dropped, with the text rows they mask,
    before both are cut: keys no query attends change no output, and what is left is often all kept (no mask)."""


@dataclass(frozen=True)
class ModelPlan:
    """How one transformer class is split. `source`: "diffusers" (its `_cp_plan` as shipped) or "streamfusion"."""

    cp_plan: ContextParallelModelPlan
    source: str
    local_attention: tuple[str, ...] = ()  # fnmatch patterns of attention modules over unsplit keys (cross-attn)
    split_key_attention: tuple[str, ...] = ()  # fnmatch patterns of attention modules whose queries are whole
    # on every rank and whose keys are the split tokens (LTX-2's audio attending the video)
    key_masks: tuple[str, ...] = ()  # forward inputs that mask keys of the split self-attention
    drop_full_masks: bool = False  # the model runs as without a key mask that keeps every key, so it is dropped
    # (its forward then reads nothing of it back to the host, which a CUDA-graph capture could not)
    adapters: dict[type, type] = field(default_factory=dict)  # stock processor -> ours (no dispatch_attention_fn)
    stock_processors: tuple[type, ...] = ()  # processors besides the modules' default that the model builds them
    # with (LTX-2.3's perturbed attention): they call dispatch_attention_fn, so they are routed as the default is
    text_last: bool = False  # the self-attention takes [image ; text] rows (else [text ; image])
    text_whole: bool = False  # the text stays whole on every rank, attended as joint tokens, at any length
    image_input: str = "hidden_states"  # the split input whose tokens the gathered output holds
    text_input: str = "encoder_hidden_states"  # the forward input of the text: its [B, L, ...] rows, or their
    # count where the text lies in a packed sequence (Cosmos3's und_len)
    guidance_batch: bool = True  # the forward can take a guidance batch for cfg parallelism to split; False:
    # one prompt per call whose layout tensors have no batch dim (MiniMax-H3, guidance-distilled), cfg refused

    @property
    def gather_module(self) -> str:
        """The one submodule whose output is gathered (the output projection)."""
        gathers = [name for name, spec in self.cp_plan.items() if isinstance(spec, ContextParallelOutput)]
        if len(gathers) != 1:
            raise ValueError(f"expected one gathered output in the context-parallel plan, got {gathers}")
        return gathers[0]

    @property
    def text_rows(self) -> bool:
        """Whether the split self-attention holds the text (`encoder_hidden_states`) as rows of its own: cut by the
        plan, or whole (`text_whole`). Else the text is only cross-attended (Wan, LTX) or packed into the split
        sequence before the cut (MiniMax-H3), so a text shorter than the ranks joins no attention as joint rows."""
        return self.text_whole or any(isinstance(spec, dict) and "encoder_hidden_states" in spec
                                      for spec in self.cp_plan.values())
