import sys

from openrecipes.cli import main

sys.exit(main())
