import sys

from jaxreshard.cli import main

sys.exit(main())
