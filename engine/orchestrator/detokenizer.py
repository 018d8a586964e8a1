"""Incremental detokenization that never emits half of a multi-byte character."""

from kvscope.engine.core.request import Sequence


def detokenize_incrementally(tokenizer, seq: Sequence, skip_special_tokens: bool = True) -> str:
    """Append the text of the sequence's newest tokens to `seq.text`; return what was added.

    Decoding only from `prefix_offset` keeps each step cheap; text ending in U+FFFD is a
    character whose bytes are not all generated yet, so it waits for the next token.
    """
    output_ids = seq.output_token_ids
    prefix_text = tokenizer.decode(output_ids[seq.prefix_offset:seq.read_offset],
                                   skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(output_ids[seq.prefix_offset:],
                                 skip_special_tokens=skip_special_tokens)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    new_text = full_text[len(prefix_text):]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(output_ids)
    seq.text += new_text
    return new_text
