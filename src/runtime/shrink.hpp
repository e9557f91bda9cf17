// Rank masking of the low-latency mode (enable_shrink; semantics.md section 9): the budget after which a silent
// rank counts as failed, decided once at creation (a pure function: tested on CPU machines).
//
//   EPX_LL_SHRINK_TIMEOUT_S  seconds, a decimal number in (0, 1e7): the budget when the Buffer option
//                            shrink_timeout_s is <= 0 (default 1 s); anything else is an error
#pragma once

namespace epx {

// The shrink budget in seconds: option_s when > 0, else env_value when set, else kDefaultShrinkTimeoutSeconds.
// Throws kInvalidArgument for an option that is NaN, infinite or >= 1e7, and for an env value that is not a number
// in (0, 1e7) (checked even where the option wins, so that a typo never goes unnoticed).
double shrink_timeout_seconds(double option_s, const char* env_value);

}  // namespace epx
