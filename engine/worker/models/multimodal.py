"""The language model of a multimodal checkpoint (Gemma3ForConditionalGeneration,
Gemma4ForConditionalGeneration, Mistral3ForConditionalGeneration,
Qwen3_5ForConditionalGeneration and its MoE): its tensors under the text model's names, the
towers that read images or audio left out by name."""

# The language model under its own prefix: as Gemma 3 was published, "language_model.model.*";
# as transformers saves these models, "model.language_model.*".
LANGUAGE_MODEL_PREFIXES = {"language_model.": "", "model.language_model.": "model."}
# Vision (and Gemma 4's audio) towers and their projections into the text, which a text-only
# model does not load ("visual": Qwen3.5's vision tower with its merger into the text).
TOWER_PREFIXES = tuple(f"{root}{part}." for root in ("", "model.")
                       for part in ("vision_tower", "multi_modal_projector", "audio_tower",
                                    "embed_vision", "embed_audio", "visual"))


def language_model_weights(weights):
    """The checkpoint's language-model tensors under the text model's names, the towers left
    out by name; anything else unknown still fails to load. A text model's checkpoint passes
    through unchanged."""
    for name, tensor in weights:
        if name.startswith(TOWER_PREFIXES):
            continue
        for prefix, replacement in LANGUAGE_MODEL_PREFIXES.items():
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        yield name, tensor
