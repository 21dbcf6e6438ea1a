#!/usr/bin/env bash
# System packages the test suite needs, from Debian: chromium (the explorer page is tested in a
# real headless browser) and the public-domain SWORD Bible modules (the corpus build is checked
# byte for byte against the shipped corpus), and g++ (attnlab builds its C++ CPU kernel at first
# use; its tests check that it built). Idempotent: installs only what is missing.
set -euo pipefail
packages=(chromium sword-text-kjv sword-text-sparv g++)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing ${missing[*]} (apt)"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
