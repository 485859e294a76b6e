#!/usr/bin/env bash
# Loopback SSH for the `ray up cluster/local.yaml` test (CI, or a dev box as root):
# installs openssh-server + rsync, creates ~/.ssh/specload_local_ed25519,
# authorizes it for root, and starts an sshd that listens on 127.0.0.1 only
# (its own config file; password login off). Idempotent.
# Env: SPECLOAD_SSH_PORT (default 22).
set -euo pipefail

PORT="${SPECLOAD_SSH_PORT:-22}"
KEY="$HOME/.ssh/specload_local_ed25519"
CFG=/etc/ssh/specload_sshd_config

if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends openssh-server openssh-client rsync >/dev/null
fi

mkdir -p "$HOME/.ssh" /run/sshd
chmod 700 "$HOME/.ssh"
[ -f "$KEY" ] || ssh-keygen -q -t ed25519 -N "" -C "specload-local" -f "$KEY"
touch "$HOME/.ssh/authorized_keys"
chmod 600 "$HOME/.ssh/authorized_keys"
grep -qF "$(cat "$KEY.pub")" "$HOME/.ssh/authorized_keys" || cat "$KEY.pub" >> "$HOME/.ssh/authorized_keys"
ssh-keygen -A >/dev/null   # host keys

cat > "$CFG" <<CONF
# specload loopback sshd (.ci/setup_ssh.sh): 127.0.0.1 only, keys only.
Port $PORT
ListenAddress 127.0.0.1
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AuthorizedKeysFile .ssh/authorized_keys
UsePAM no
Subsystem sftp internal-sftp
PidFile /run/sshd-specload.pid
CONF

if ! (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
  /usr/sbin/sshd -f "$CFG"
fi

# Known host entry so plain `ssh` works too (ray up passes StrictHostKeyChecking=no).
ssh-keyscan -p "$PORT" -H 127.0.0.1 2>/dev/null >> "$HOME/.ssh/known_hosts" || true
ssh -p "$PORT" -i "$KEY" -o BatchMode=yes -o StrictHostKeyChecking=no root@127.0.0.1 true
echo "sshd on 127.0.0.1:$PORT, key $KEY"
