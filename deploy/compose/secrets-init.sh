#!/bin/sh
# The compose stack's `secrets-init`: runs once, as root, before every other
# service, and hands each consumer its own copy of the secrets it needs.
#
# Why: Compose mounts a file-based secret by binding the host file into the
# container as it is. It ignores the secret's uid/gid/mode, so the file keeps
# its host owner and make-secrets.sh's 0600, and nobody but that host uid can
# read it. The consumers run as fixed uids (redis 999, prometheus 65534, grafana
# 472, kuangchao 1000). Root can read the originals; it copies each into the
# `kc-secrets` volume, one folder per consumer, owned by that consumer's uid
# with mode 0400. Each service mounts only its own folder (volume subpath), so
# the API never sees the signing key and a worker sees nothing at all.
#
# Args: CONSUMER:UID:GID:SECRET[,SECRET...] ...   (from deploy/docker-compose.yml)
set -eu

src=${KC_SECRETS_SRC:-/run/secrets}
out=${KC_SECRETS_OUT:-/kc-secrets}

[ "$#" -gt 0 ] || { echo "secrets-init: no CONSUMER:UID:GID:SECRETS given" >&2; exit 2; }
[ -d "$out" ] || { echo "secrets-init: $out is not mounted" >&2; exit 2; }

# Start from nothing: a secret taken out of the mapping must not linger.
find "$out" -mindepth 1 -delete

for spec in "$@"; do
  IFS=: read -r consumer uid gid files <<EOF
$spec
EOF
  case "$consumer" in ''|*/*|.*) echo "secrets-init: bad consumer in '$spec'" >&2; exit 2 ;; esac
  [ -n "$uid" ] && [ -n "$gid" ] && [ -n "$files" ] || {
    echo "secrets-init: '$spec' is not CONSUMER:UID:GID:SECRET[,SECRET...]" >&2; exit 2; }
  install -d -m 0500 -o "$uid" -g "$gid" "$out/$consumer"
  old_ifs=$IFS
  IFS=,
  for f in $files; do
    [ -s "$src/$f" ] || {
      echo "secrets-init: secret $f is missing or empty; run deploy/make-secrets.sh" >&2; exit 2; }
    install -m 0400 -o "$uid" -g "$gid" "$src/$f" "$out/$consumer/$f"
  done
  IFS=$old_ifs
  echo "secrets-init: $consumer ($uid:$gid): $files"
done
