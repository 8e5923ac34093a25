from lit_template.utils.instantiators import instantiate_callbacks, instantiate_loggers
from lit_template.utils.pylogger import RankedLogger
from lit_template.utils.task import task_wrapper

__all__ = ["RankedLogger", "instantiate_callbacks", "instantiate_loggers", "task_wrapper"]
