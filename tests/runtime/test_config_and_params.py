from __future__ import annotations

import argparse

import pytest

from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.io_struct import BatchTokenIDOut, TokenizedGenerateReq, TokenRow, decode, encode
from radixlang.runtime.sampling.sampling_params import SamplingParams


def test_cli_generated_from_fields():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--port", "1234", "--disable-radix-cache",
                                                       "--schedule-policy", "fcfs"]))
    assert args.port == 1234 and args.disable_radix_cache and args.schedule_policy == "fcfs"
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule-policy", "random"])


def test_server_args_validation_and_resolve():
    with pytest.raises(TypeError):
        ServerArgs(prot=1)
    with pytest.raises(ValueError, match="attention_backend"):
        ServerArgs(attention_backend="magic")
    resolved = ServerArgs().resolve()
    assert resolved.device in ("cpu", "cuda") and resolved.dtype != "auto" and resolved.attention_backend != "auto"


@pytest.mark.parametrize("bad,match", [
    ({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"), ({"max_new_tokens": -2}, "max_new_tokens"),
    ({"top_k": 0}, "top_k"), ({"n": 0}, "n must"), ({"stop": [1]}, "stop"), ({"regex": "a", "json_schema": "{}"},
                                                                            "only one"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"), ({"bogus": 1}, "unknown sampling"),
])
def test_sampling_params_reject(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.from_dict(bad)


def test_sampling_params_normalize():
    p = SamplingParams.from_dict({"stop": "###", "json_schema": {"type": "object"}})
    assert p.stop == ["###"] and p.grammar_key == ("json", '{"type": "object"}')
    assert SamplingParams(temperature=0).is_greedy


def test_codec_roundtrip_and_refuses_unknown():
    req = TokenizedGenerateReq(rid="a", input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=3))
    assert decode(encode(req)) == req
    with pytest.raises(ValueError):
        decode(b'{"t": "os.system", "d": {}}')
    out = BatchTokenIDOut(rows=[TokenRow(rid="a", output_ids=[1], finished_reason=None, prompt_tokens=2,
                                         completion_tokens=1, cached_tokens=0, stop_strs=["x"],
                                         output_token_logprobs=[[-0.5, 1]])])
    back = decode(encode(out))
    assert back == out and isinstance(back.rows[0], TokenRow)
