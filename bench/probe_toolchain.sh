#!/usr/bin/env bash
# Probe (GPU machine, no GPU needed): does the image's C++ compiler link libstdc++ statically into a
# shared object? On 2026-12-03 our extension there had no libstdc++.so.6 dependency, held libstdc++'s
# own code, and crashed in std::ostream number formatting (every c10::str/TORCH_CHECK message).
# Builds the same 6-line library twice (as is; with -l:libstdc++.so.6) and formats a number in each.
set -u
echo "c++ -> $(readlink -f "$(command -v c++)")   g++ -> $(readlink -f "$(command -v g++)")"
for f in libstdc++.so libstdc++.a; do echo "g++ -print-file-name=$f -> $(g++ -print-file-name=$f)"; done
ls -l /usr/lib/gcc/x86_64-linux-gnu/*/libstdc++* 2>&1 | head -4
python3 - <<'PY'
import sysconfig as s
for k in ("CXX", "LDSHARED", "LDCXXSHARED"):
    print(k, "=", s.get_config_var(k))
PY
d=$(mktemp -d)
cat > "$d/fmt.cpp" <<'CPP'
#include <sstream>
#include <string>
#include <cstring>
extern "C" int fmt(char* out, long n) { std::ostringstream s; s << "n=" << n; std::strcpy(out, s.str().c_str()); return 0; }
CPP
for variant in plain shared-libstdcxx; do
  extra=""; [ "$variant" = shared-libstdcxx ] && extra="-l:libstdc++.so.6"
  g++ -O2 -fPIC -shared "$d/fmt.cpp" -o "$d/$variant.so" $extra
  deps=$(ldd "$d/$variant.so" | grep -c "libstdc++")
  python3 -c "
import ctypes, sys
b = ctypes.create_string_buffer(64); ctypes.CDLL(sys.argv[1]).fmt(b, 12345); print(b.value.decode())" "$d/$variant.so" >"$d/out" 2>&1
  echo "$variant: libstdc++.so deps=$deps rc=$? -> $(cat "$d/out" | tail -1)"
done
