"""The optional C kernel of the compressed exchange (lightning_decentral/compression/_kernels.c); everything else about
the package is in pyproject.toml.

`pip install -e .` (or `python setup.py build_ext --inplace`) compiles it where a C compiler is found; where the
build fails the package installs without it and the torch path runs (lightning_decentral/compression/native.py).
The flags keep its floating-point results those of the torch path: no FMA contraction, no fast-math, no
`-march=native` (the build runs on other machines than the one that compiled it; AVX2 is chosen at load time where
the compiler supports it)."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FLAGS = {
    "unix": ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-std=c11"],
    "mingw32": ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-std=c11"],
    "msvc": ["/O2", "/fp:precise"],
}


class BuildExt(build_ext):
    """Compile with the flags of the compiler found (`FLAGS`)."""

    def build_extensions(self) -> None:
        for extension in self.extensions:
            extension.extra_compile_args = FLAGS.get(self.compiler.compiler_type, [])
            extension.libraries = ["m"] if self.compiler.compiler_type != "msvc" else []  # fmaf
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "lightning_decentral.compression._kernels", ["lightning_decentral/compression/_kernels.c"], optional=True
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
