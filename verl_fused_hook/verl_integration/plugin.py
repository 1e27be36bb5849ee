"""Entry point of the `verl.plugins` group: `import verl` imports this module in every process."""

from . import install

install()
