#!/usr/bin/env bash
# Entrypoint of the kuangchao image (deploy/Dockerfile: tini -g -- kc-entrypoint CMD...).
#
# 1. KC_REDIS_URL. kuangchao reads the admin Redis URL from the environment,
#    but a deployment hands out the password as a file. When KC_REDIS_URL is
#    unset and KC_REDIS_PASSWORD_FILE is set, the URL is built here:
#      redis://${KC_REDIS_USER:-kc-admin}:PASSWORD@${KC_REDIS_HOST:-redis}:${KC_REDIS_PORT:-6379}/${KC_REDIS_DB:-0}
#    Only this process tree sees it, never the compose file or `docker inspect`.
# 2. The operator's object-store keys. For each of AWS_ACCESS_KEY_ID,
#    AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN that is unset, while
#    NAME_FILE names a file, NAME is read from that file (one line), for the
#    control plane and the API (compose/object-store.yml).
# 3. KC_CONTROL_PLANE_ARGS. When set, `kc control-plane start $KC_CONTROL_PLANE_ARGS`
#    runs beside the command (the Ray head). It must share the head's
#    container: a Ray driver attaches to a raylet it finds among its own
#    processes, through the head's /tmp/ray sockets and /dev/shm. It starts once
#    the Ray address it names accepts connections, is started again (backing
#    off from KC_CONTROL_PLANE_RETRY_S, default 5, to 60 s) whenever it exits
#    while the head runs, and the container ends with the head, with the
#    head's exit status.
#    The command itself (the Ray head's raylet, whose environment every worker
#    and driver on the head inherits) runs without the secrets: without
#    KC_REDIS_URL, KC_REDIS_PASSWORD_FILE, KC_SIGNING_KEY_FILE,
#    KC_ADMIN_KEY_FILE and the object-store keys (AWS_ACCESS_KEY_ID,
#    AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN and their _FILE names). With
#    KC_REDIS_URL_FILE set, the admin URL is written there (mode 0600) for
#    `ray job submit` drivers, which read it from the file.
# 4. Otherwise the command replaces this script.
set -euo pipefail

log() { echo "kc-entrypoint: $*" >&2; }
die() { log "$*"; exit 2; }

if [[ -z ${KC_REDIS_URL:-} && -n ${KC_REDIS_PASSWORD_FILE:-} ]]; then
  [[ -r $KC_REDIS_PASSWORD_FILE ]] || die "cannot read KC_REDIS_PASSWORD_FILE=$KC_REDIS_PASSWORD_FILE"
  password=$(<"$KC_REDIS_PASSWORD_FILE")
  # No percent-encoding here: refuse what would need it.
  [[ $password =~ ^[A-Za-z0-9._~-]+$ ]] ||
    die "the password in $KC_REDIS_PASSWORD_FILE must be one line of [A-Za-z0-9._~-]" \
        "(deploy/make-secrets.sh writes hex); or set KC_REDIS_URL yourself"
  export KC_REDIS_URL="redis://${KC_REDIS_USER:-kc-admin}:${password}@${KC_REDIS_HOST:-redis}:${KC_REDIS_PORT:-6379}/${KC_REDIS_DB:-0}"
  unset password
fi

for name in AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN; do
  file_var=${name}_FILE
  [[ -z ${!name:-} && -n ${!file_var:-} ]] || continue
  [[ -r ${!file_var} ]] || die "cannot read $file_var=${!file_var}"
  value=$(<"${!file_var}")
  # One line, no blanks: a stray newline or space would reach the store's
  # signature check as part of the key.
  [[ -n $value && $value != *[[:space:]]* ]] ||
    die "$file_var=${!file_var} must hold one line without spaces (the key, as the store gave it)"
  export "$name=$value"
done
unset name file_var value

(( $# )) || set -- kc --help
[[ -n ${KC_CONTROL_PLANE_ARGS:-} ]] || exec "$@"

read -ra cp_args <<<"$KC_CONTROL_PLANE_ARGS"
address=${KC_RAY_ADDRESS:-127.0.0.1:6379}
for i in "${!cp_args[@]}"; do
  case "${cp_args[i]}" in
    --address) address=${cp_args[i + 1]:-$address} ;;
    --address=*) address=${cp_args[i]#--address=} ;;
  esac
done

main='' cp='' stopping=''
# The main process' exit status. When bash has already reaped it, `wait` cannot
# tell (127, or -1 after a signal): then it ended by the stop signal, 143.
main_status() {
  local rc=0
  wait "$main" 2>/dev/null || rc=$?
  (( rc >= 0 && rc <= 255 && rc != 127 )) || rc=143
  return "$rc"
}
# tini -g has already sent the signal to every process of the group; this only
# makes sure the loop below stops starting the control plane and waits.
trap 'stopping=1; kill -TERM $main $cp 2>/dev/null || true' TERM INT

if [[ -n ${KC_REDIS_URL_FILE:-} && -n ${KC_REDIS_URL:-} ]]; then
  mkdir -p "$(dirname "$KC_REDIS_URL_FILE")"
  (umask 077 && printf '%s\n' "$KC_REDIS_URL" >"$KC_REDIS_URL_FILE")
fi
env -u KC_REDIS_URL -u KC_REDIS_PASSWORD_FILE -u KC_SIGNING_KEY_FILE -u KC_ADMIN_KEY_FILE \
  -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_SESSION_TOKEN \
  -u AWS_ACCESS_KEY_ID_FILE -u AWS_SECRET_ACCESS_KEY_FILE -u AWS_SESSION_TOKEN_FILE "$@" &
main=$!

until (exec 3<>"/dev/tcp/${address%:*}/${address##*:}") 2>/dev/null; do
  if [[ -n $stopping ]] || ! kill -0 "$main" 2>/dev/null; then
    main_status && exit 0 || exit $?
  fi
  sleep 1
done

delay=${KC_CONTROL_PLANE_RETRY_S:-5}
while [[ -z $stopping ]]; do
  kill -0 "$main" 2>/dev/null || { main_status && exit 0 || exit $?; }
  log "starting: kc control-plane start ${cp_args[*]}"
  kc control-plane start "${cp_args[@]}" &
  cp=$!
  done_pid=
  wait -n -p done_pid "$main" "$cp" && rc=0 || rc=$?
  if [[ ${done_pid:-} == "$main" ]]; then
    log "the main process exited ($rc); stopping the control plane"
    kill -TERM "$cp" 2>/dev/null || true
    wait "$cp" 2>/dev/null || true
    exit "$rc"
  fi
  [[ -z $stopping ]] || break
  log "the control plane exited ($rc); starting it again in ${delay}s"
  sleep "$delay" &
  wait $! || true
  delay=$(( delay * 2 > 60 ? 60 : delay * 2 ))
done

# Stopping: both got the signal.
wait "$cp" 2>/dev/null || true
main_status && exit 0 || exit $?
