"""Healing text that a registry ships: the reStructuredText sources of Debian's `linux-doc-6.1`.

    python eval/prepare_heal_data.py --output .data/linux-doc.jsonl

Downloads the .deb with `apt-get download` (Debian's package registry), unpacks it with `dpkg -x`
and writes one JSON line per document ({"text": ...}) of at least --min-chars characters: English
technical prose, disjoint from the news articles the evaluation uses (linux-doc-6.1 6.1.176-1, fetched
2026-11-24: 2099 documents, 22.2M characters; the count moves with Debian's point releases).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "linux-doc-6.1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=".data/linux-doc.jsonl")
    parser.add_argument("--min-chars", type=int, default=2000, help="skip stubs shorter than this")
    args = parser.parse_args()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True)
        deb = next(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        subprocess.run(["dpkg", "-x", str(deb), str(Path(tmp) / "root")], check=True)
        files = sorted((Path(tmp) / "root").rglob("*.rst.gz"))
        count = chars = 0
        with open(out, "w") as f:
            for path in files:
                text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace").strip()
                if len(text) < args.min_chars:
                    continue
                f.write(json.dumps({"text": text, "source": path.name}) + "\n")
                count += 1
                chars += len(text)
    print(f"wrote {count} documents, {chars / 1e6:.1f}M characters to {out}")


if __name__ == "__main__":
    main()
