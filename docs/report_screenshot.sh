#!/usr/bin/env bash
# Remake docs/report.png: the HTML report of `zeus-callbacks demo --report` (SIMULATED A40), opened in headless
# Chromium (Debian: apt-get install -y chromium). The price is an example figure; DE's intensity is the shipped one.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
zeus-callbacks demo --report "$out/demo.html" --region DE --price 0.15 >/dev/null
chromium --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
  --disable-sync --no-first-run --hide-scrollbars --user-data-dir="$out/profile" --window-size=1000,3000 \
  --screenshot="$out/full.png" "file://$out/demo.html" 2>/dev/null
# Crop to the page's content and keep 96 colours: small enough to commit (< 300 KB).
python - "$out/full.png" docs/report.png <<'PY'
import sys
from PIL import Image, ImageChops
im = Image.open(sys.argv[1]).convert("RGB")
bg = Image.new("RGB", im.size, im.getpixel((im.width - 1, im.height - 1)))
box = ImageChops.difference(im, bg).getbbox()
im = im.crop((0, 0, im.width, min(im.height, box[3] + 16)))
im.quantize(colors=96, method=Image.Quantize.MEDIANCUT).save(sys.argv[2], optimize=True)
PY
rm -rf "$out"
ls -l docs/report.png
