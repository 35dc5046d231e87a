#!/usr/bin/env bash
# Generate the secrets of the docker-compose stack (deploy/docker-compose.yml).
#
#   deploy/make-secrets.sh [--force] [DIR]     DIR defaults to deploy/secrets
#   AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \
#     deploy/make-secrets.sh --object-store [--force] [DIR]
#
# Writes, each mode 0600 in a 0700 folder:
#   redis-password          the Redis admin user's password (hex: URL-safe as it is,
#                           because the image's entrypoint puts it into KC_REDIS_URL)
#   redis-users.acl         Redis ACL file: `default` off, `kc-admin` with that password
#                           (stored as its SHA-256, so the plaintext stays out of Redis' files)
#   signing-key.pem         the token authority's Ed25519 key, PKCS8 PEM
#   admin-api-key           the bootstrap admin API key, kc_<16 hex>_<43 url-safe chars>
#   metrics-token           the bearer token Prometheus sends to the API's /metrics
#   grafana-admin-password  Grafana's `admin` password
#   ray-token               Ray's authentication token (RAY_AUTH_MODE=token): every
#                           raylet, the API and `ray job submit` present it
#
# Refuses to overwrite an existing secret unless --force: replacing them on a
# running stack rotates every credential at once (see docs/operator-guide.md).
#
# --object-store writes only the object store's keys, for
# deploy/compose/object-store.yml, taken from the environment (not arguments,
# which other users see in `ps`) and touching no other file:
#   object-store-access-key-id      AWS_ACCESS_KEY_ID
#   object-store-secret-access-key  AWS_SECRET_ACCESS_KEY
# --force then replaces just those two.
set -euo pipefail

FILES=(redis-password redis-users.acl signing-key.pem admin-api-key metrics-token
       grafana-admin-password ray-token)
OBJECT_STORE_FILES=(object-store-access-key-id object-store-secret-access-key)

usage() { echo "usage: $0 [--force] [--object-store] [DIR]" >&2; exit 2; }

force=0
object_store=0
dir=
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    --object-store) object_store=1 ;;
    -h|--help) usage ;;
    -*) echo "unknown option $arg" >&2; usage ;;
    *) [[ -z $dir ]] || usage; dir=$arg ;;
  esac
done
dir=${dir:-"$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets"}

if [[ $object_store == 1 ]]; then
  # One line each, no blanks: kc-entrypoint reads them back into the variables.
  for var in AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY; do
    val=${!var:-}
    [[ -n $val && $val != *[[:space:]]* ]] || {
      echo "$0 --object-store: set $var (the store's key, one word) in the environment" >&2
      exit 2; }
  done
  if [[ $force == 0 ]]; then
    existing=()
    for f in "${OBJECT_STORE_FILES[@]}"; do [[ -e $dir/$f ]] && existing+=("$f"); done
    if (( ${#existing[@]} )); then
      echo "$dir already holds ${existing[*]}; not overwriting. Pass --force to replace them." >&2
      exit 1
    fi
  fi
  umask 077
  mkdir -p "$dir"
  chmod 0700 "$dir"
  tmp=$(mktemp -d "$dir/.new.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  printf '%s\n' "$AWS_ACCESS_KEY_ID" >"$tmp/object-store-access-key-id"
  printf '%s\n' "$AWS_SECRET_ACCESS_KEY" >"$tmp/object-store-secret-access-key"
  for f in "${OBJECT_STORE_FILES[@]}"; do
    chmod 0600 "$tmp/$f"
    mv -f "$tmp/$f" "$dir/$f"
  done
  echo "wrote ${OBJECT_STORE_FILES[*]} to $dir (mode 0600)"
  exit 0
fi

command -v openssl >/dev/null || { echo "$0 needs openssl on PATH" >&2; exit 2; }

if [[ $force == 0 ]]; then
  existing=()
  for f in "${FILES[@]}"; do [[ -e $dir/$f ]] && existing+=("$f"); done
  if (( ${#existing[@]} )); then
    echo "$dir already holds ${existing[*]}; not overwriting. Pass --force to replace" \
         "them all (every credential of a running stack changes)." >&2
    exit 1
  fi
fi

umask 077
mkdir -p "$dir"
chmod 0700 "$dir"

# Everything goes to a scratch folder first and is moved in at the end, so a
# failure halfway leaves the old set (or none), never a mix of old and new.
tmp=$(mktemp -d "$dir/.new.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# 32 random bytes as base64url without padding: exactly 43 characters.
b64url32() { openssl rand -base64 32 | tr -d '\n=' | tr '+/' '-_'; }

redis_password=$(openssl rand -hex 32)
printf '%s\n' "$redis_password" >"$tmp/redis-password"

redis_hash=$(printf '%s' "$redis_password" | openssl dgst -sha256 -r | cut -d' ' -f1)
# The control plane adds per-job users at run time (ACL SETUSER); they live in
# memory only, and its token authority re-creates them after a Redis restart.
cat >"$tmp/redis-users.acl" <<EOF
user default off resetkeys resetchannels -@all
user kc-admin on #$redis_hash ~* &* +@all
EOF

openssl genpkey -algorithm ed25519 -out "$tmp/signing-key.pem" 2>/dev/null

printf 'kc_%s_%s\n' "$(openssl rand -hex 8)" "$(b64url32)" >"$tmp/admin-api-key"
printf '%s\n' "$(b64url32)" >"$tmp/metrics-token"
printf '%s\n' "$(b64url32)" >"$tmp/grafana-admin-password"
openssl rand -hex 32 >"$tmp/ray-token"

for f in "${FILES[@]}"; do
  chmod 0600 "$tmp/$f"
  mv -f "$tmp/$f" "$dir/$f"
done
echo "wrote ${FILES[*]} to $dir (mode 0600)"
