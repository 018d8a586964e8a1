"""Structured outputs (llguidance): every output parses and validates, also for sequences
preempted mid-generation (recompute and swap), mixed with unconstrained rows in one batch."""

import json
import re

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest
import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.request import Request, Sequence
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sample.structured_output import llguidance_tokenizer
from kvscope.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvscope.engine.worker.loader import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON: "


def engine_for(path, **knobs) -> EngineCore:
    knobs = {"max_model_len": 256, **knobs}
    return EngineCore(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                   device_memory_gb=0.05, **knobs))


def constrained(**spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=150, seed=None,
                          structured_outputs=StructuredOutputsParams(**spec))


def texts(run) -> list[str]:
    return [c.text for output in run.outputs for c in output.outputs]


@pytest.fixture(scope="module")
def engine(tiny_byte_level_model_path) -> EngineCore:
    return engine_for(tiny_byte_level_model_path)


def test_json_schema_outputs_parse_and_validate(engine, run_engine):
    run = run_engine(engine, [PROMPT] * 6, SamplingParams(
        n=2, temperature=1.0, max_tokens=150, structured_outputs=StructuredOutputsParams(
            json=SCHEMA)))
    for output in run.outputs:
        for sample in output.outputs:
            assert sample.finish_reason == "stop", sample.text
            jsonschema.validate(json.loads(sample.text), SCHEMA)
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize(("spec", "check"), [
    ({"regex": r"[a-z]{2,5}-\d{3}"}, lambda t: re.fullmatch(r"[a-z]{2,5}-\d{3}", t)),
    ({"choice": ["yes", "no", "it depends"]}, lambda t: t in ("yes", "no", "it depends")),
    ({"grammar": 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'},
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    ({"grammar": 'root ::= "a" ("b" | "c")+ "."'}, lambda t: re.fullmatch(r"a[bc]+\.", t)),
])
def test_regex_choice_and_grammars_hold(engine, run_engine, spec, check):
    run = run_engine(engine, [PROMPT] * 4, constrained(**spec))
    for text in texts(run):
        assert check(text), text


def test_json_object_gives_objects(engine, run_engine):
    """Any object: a random model's strings may never end, so a bias on `"` and `}` (which
    composes with the grammar) lets each object close well within max_tokens."""
    closing = engine.tokenizer.convert_tokens_to_ids(['"', "}"])
    params = SamplingParams(temperature=1.0, max_tokens=150, logit_bias={t: 6 for t in closing},
                            structured_outputs=StructuredOutputsParams(json_object=True))
    for text in texts(run_engine(engine, [PROMPT] * 4, params)):
        assert isinstance(json.loads(text), dict), text


def test_constrained_and_free_rows_share_a_batch(engine, run_engine):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = run_engine(engine, [PROMPT], free).outputs[0].outputs[0].token_ids
    run = run_engine(engine, [PROMPT] * 4, [constrained(json=SCHEMA), free,
                                            constrained(choice=["a", "b"]), free])
    assert run.outputs[1].outputs[0].token_ids == alone
    assert run.outputs[3].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(run.outputs[0].outputs[0].text), SCHEMA)
    assert run.outputs[2].outputs[0].text in ("a", "b")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_stay_valid_when_sequences_are_preempted(tiny_byte_level_model_path,
                                                         run_engine, mode):
    engine = engine_for(tiny_byte_level_model_path, block_size=8, num_gpu_blocks_override=28,
                        max_model_len=200,
                        preemption_mode=mode, swap_space=0.01)
    params = [constrained(json=SCHEMA), constrained(regex=r"[a-z]{20,40}")] * 6
    run = run_engine(engine, [PROMPT] * len(params), params)
    assert sum(len(record.preempted) for record in run.records) > 0, "nothing was preempted"
    preempted = [o for o in run.outputs if o.metrics.num_preemptions > 0]
    assert preempted
    for output, p in zip(run.outputs, params, strict=True):
        text = output.outputs[0].text
        if p.structured_outputs.json is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(r"[a-z]{20,40}", text), text
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_the_batch_mask_equals_llguidances_own(engine):
    """Constrained rows part-way through their grammars, between free rows: the rows
    llguidance's numpy reference masks with each matcher's own bitmask, the free rows as
    they were."""
    processor = engine.logits_processor
    rows = [(constrained(json=SCHEMA), '{"name":"ab'), (SamplingParams(), "free"),
            (constrained(regex=r"[a-z]{2,5}-\d{3}"), "abc-1"),
            (constrained(choice=["yes", "no"]), ""), (SamplingParams(), "free"),
            (constrained(json=SCHEMA), '{"name":"x","age":1')]
    seqs = []
    for index, (params, output) in enumerate(rows):
        request = Request(f"mask-{index}", None, [1, 2], params,
                          constraints=processor.prepare(params))
        output_ids = engine.tokenizer.encode(output, add_special_tokens=False)
        seqs.append(Sequence(request.request_id, request, 0, [1, 2] + output_ids, 2))
    logits = torch.randn(len(rows), processor.vocab_size,
                         generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    processor.structured.apply_bitmask(masked, seqs)

    expected = logits.numpy().copy()
    for row, seq in enumerate(seqs):
        if seq.request.constraints is None:
            continue
        matcher = llguidance.LLMatcher(processor.structured.compiler.tokenizer,
                                       seq.request.constraints.grammar)
        assert matcher.consume_tokens(seq.output_token_ids), matcher.get_error()
        bitmask = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
        llguidance.numpy.apply_token_bitmask_inplace(expected[row], bitmask)
    assert torch.equal(masked, torch.from_numpy(expected))
    assert all(masked[row].isinf().any() for row in (0, 2, 3, 5))


def test_llguidances_tokenizer_is_built_once_per_tokenizer(tiny_byte_level_model_path):
    first = load_tokenizer(tiny_byte_level_model_path)
    again = load_tokenizer(tiny_byte_level_model_path)  # another object, the same tokenizer
    built = llguidance_tokenizer(first, len(first), [0])
    assert llguidance_tokenizer(again, len(again), [0]) is built
    assert llguidance_tokenizer(again, len(again), [1]) is not built  # other EOS ids
    assert llguidance_tokenizer(again, len(again) + 8, [0]) is not built  # a larger vocab


@pytest.mark.parametrize(("spec", "message"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
     "structured_outputs.json: cannot compile"),
    ({"regex": "[a-z"}, "structured_outputs.regex: cannot compile"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar: cannot compile"),
    ({"json": "{not json"}, "structured_outputs.json: "),
    # Found by tests/fuzz: text that is neither Lark nor GBNF raised a bare Exception (a 500).
    ({"grammar": "x"}, "structured_outputs.grammar: not a Lark or GBNF grammar: Expected ::="),
    ({"grammar": ""}, "structured_outputs.grammar: not a Lark or GBNF grammar: No 'root'"),
])
def test_an_uncompilable_spec_is_refused_naming_the_field(engine, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request(PROMPT, constrained(**spec))
    assert not engine.has_unfinished_requests()


def test_exactly_one_kind_of_structure():
    with pytest.raises(ValueError, match="structured_outputs: give exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs: give exactly one"):
        StructuredOutputsParams()
