#include "policy.h"
const policy_ops *policy_find(const char *n) { (void)n; return 0; }
