from toolkit.cli import main
from toolkit.process_exit import leave

leave(main())
