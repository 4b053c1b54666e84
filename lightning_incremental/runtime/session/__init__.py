"""One run's lifecycle as every adapter shares it: its options (:mod:`.options`) and a start
from another run's checkpoint (:mod:`.fork`)."""
