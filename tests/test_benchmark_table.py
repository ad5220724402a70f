"""benchmarks/throughput.py's printed table: every column lines up, whatever the variant names."""

from __future__ import annotations

from pathlib import Path


def test_the_throughput_table_aligns_for_the_longest_variant_name(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import throughput

    rows = [
        dict(engine="shmvllm", workload="throughput", wall_s=23.39, output_tokens=8192, tok_per_s=350.2, load_s=9.4),
        dict(engine="shmvllm-fp32-no-chunking", workload="single", wall_s=1.33, output_tokens=128, tok_per_s=96.1,
             ttft_s=0.0439, decode_tok_per_s=98.6, load_s=12.3),
    ]
    header, first, second = throughput.table_lines(rows)
    # text columns start where their header starts; numbers end where theirs ends
    assert first.index("throughput") == second.index("single") == header.index("workload")
    for head, a, b in (("wall_s", "23.39", "1.33"), ("tokens", "8192", "128"), ("tok/s", "350.2", "96.1"),
                       ("load_s", "9.4", "12.3")):
        end = header.index(head) + len(head)
        assert first.index(a) + len(a) == second.index(b) + len(b) == end, head
    assert second.index("43.9") + 4 == header.index("ttft_ms") + len("ttft_ms")
    assert second.index("98.6") + 4 == header.index("decode tok/s") + len("decode tok/s")
