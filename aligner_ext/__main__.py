import sys

from aligner_ext.cli import main

sys.exit(main())
