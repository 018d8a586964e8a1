"""What every reasoning parser does: thinking between a start and an end marker."""

from dataclasses import dataclass


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (text still
    growing holds them back until the next characters say whether the marker came)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


@dataclass(frozen=True, slots=True)
class Reasoning:
    reasoning: str
    content: str
    ended: bool  # the end marker came: whatever follows is the answer


class ReasoningParser:
    """Thinking is the text between `start` and `end`; the answer is what follows `end`.

    `extract(text, final)` answers for the output so far. While the output still grows
    (`final=False`) it keeps back a tail that may be the start of a marker, so what it
    returns only ever grows: a stream sends the difference between two answers.
    """

    start = "<think>"
    end = "</think>"
    # Whether output with no start marker is thinking (the template opened it in the
    # prompt) or a plain answer (thinking was switched off).
    thinks_without_start = True
    # Whether the markers are special tokens, which the output's text must then keep
    # (the request is detokenized with skip_special_tokens=False).
    reads_special_tokens = False

    def __init__(self, prompt: str = "") -> None:
        """`prompt`: the rendered prompt; one that leaves a thinking block open means the
        output starts inside it, whatever the model's default."""
        if prompt.rfind(self.start) > prompt.rfind(self.end):
            self.thinks_without_start = True

    def extract(self, text: str, final: bool) -> Reasoning:
        if not final and held_back(text, self.start) == len(text) and text:
            return Reasoning("", "", False)  # perhaps the start marker, still arriving
        if text.startswith(self.start):
            text = text[len(self.start):]
        elif not self.thinks_without_start:
            return Reasoning("", text, False)
        end = text.find(self.end)
        if end >= 0:
            return Reasoning(text[:end], text[end + len(self.end):], True)
        keep = len(text) if final else len(text) - held_back(text, self.end)
        return Reasoning(text[:keep], "", False)
