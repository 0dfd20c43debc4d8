"""Running a looped model: building it (``convert``, ``load``, ``cast``), the model itself, its
cached decode paths and decode loop, and device handling."""
