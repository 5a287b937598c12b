"""The decoding benchmark runs end to end on a tiny model and writes the documented JSON (no timing thresholds)."""

import json

from benchmarks.decode import main

TINY = "dim=32,n_layer=1,n_head=2,vocab_size=64,caption_dim=16,cls_token_num=4,block_size=16"


def test_decode_bench_writes_schema(tmp_path):
    out = tmp_path / "decode.json"
    result = main(["--out", str(out), "--batch-sizes", "1,2", "--tokens", "3", "--repeats", "1",
                   "--threads", "1", "--override", TINY])
    written = json.loads(out.read_text())
    assert written == result
    assert set(written) == {"batch_1", "batch_2", "meta"}
    for key in ("batch_1", "batch_2"):
        row = written[key]
        assert set(row) == {"ours_tok_s", "hf_tok_s", "ratio"}
        assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["ratio"] > 0
    meta = written["meta"]
    for field in ("config", "threads", "device", "torch", "transformers", "tokens", "repeats", "weights"):
        assert field in meta
    assert meta["tokens"] == 3 and meta["repeats"] == 1 and meta["threads"] == 1
    assert meta["model"]["dim"] == 32 and meta["weights"].startswith("random")
