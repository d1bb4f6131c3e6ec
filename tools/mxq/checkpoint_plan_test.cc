#include "checkpoint_test_util.hpp"
