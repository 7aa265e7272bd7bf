#!/usr/bin/env bash
# Unpack a redis-server from Debian package files into a directory, without installing
# anything, for a machine that has no redis-server and no network (the GPU machine).
#
#   scripts/unpack_redis.sh DEB_DIR OUT_DIR
#
# DEB_DIR holds the .deb files: redis-server and redis-tools (Debian's redis-server
# binary is a symlink into redis-tools: redis-check-rdb, which runs as the server when
# called by that name), and the shared libraries the machine lacks; on Debian 12 those
# are usually libjemalloc2 and liblzf1, and perhaps libssl3, libsystemd0 (see `ldd`).
# Each is extracted with `dpkg-deb -x` into OUT_DIR/root; OUT_DIR/redis-server is a
# wrapper that runs the binary with LD_LIBRARY_PATH on the extracted libraries. The
# script prints the wrapper's `--version` and fails, naming them, if a library is
# still missing.
#
# Then: REDIS_SERVER=OUT_DIR/redis-server scripts/two_node_cache.sh
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 DEB_DIR OUT_DIR" >&2
    exit 2
fi
debs=$1
out=$(mkdir -p "$2" && cd "$2" && pwd)
root=$out/root
mkdir -p "$root"

shopt -s nullglob
found=0
for deb in "$debs"/*.deb; do
    dpkg-deb -x "$deb" "$root"
    echo "unpacked $(basename "$deb")"
    found=1
done
if [ "$found" = 0 ]; then
    echo "$0: no .deb files in $debs" >&2
    exit 1
fi
if [ ! -e "$root/usr/bin/redis-server" ] || [ ! -e "$root/usr/bin/redis-check-rdb" ]; then
    echo "$0: $debs needs both redis-server_*.deb and redis-tools_*.deb" \
        "(usr/bin/redis-server links to redis-check-rdb)" >&2
    exit 1
fi

libs=$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu
cat >"$out/redis-server" <<EOF
#!/usr/bin/env bash
# made by scripts/unpack_redis.sh: the unpacked redis-server with its libraries
export LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$root/usr/bin/redis-server" "\$@"
EOF
chmod +x "$out/redis-server"

missing=$(LD_LIBRARY_PATH="$libs" ldd "$root/usr/bin/redis-check-rdb" | grep "not found" || true)
if [ -n "$missing" ]; then
    echo "$0: libraries still missing (add their .deb files to $debs):" >&2
    echo "$missing" >&2
    exit 1
fi
"$out/redis-server" --version
echo "REDIS_SERVER=$out/redis-server"
